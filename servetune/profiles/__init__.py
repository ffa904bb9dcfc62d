"""GPU x model profiles: KV memory, the step-time model, fitting, building, measuring."""
