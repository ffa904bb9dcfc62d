"""CLI: ``servetune export``: a policy as an engine's config file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from servetune.cli.options import JsonOption, print_json
from servetune.engines import DISAGG_ROLES as ROLES
from servetune.engines import ENGINE_NAMES
from servetune.errors import ServetuneError
from servetune.io import STDOUT, check_outputs, write_all_or_none, write_text_atomic

if TYPE_CHECKING:  # imported where used: see the lazy imports
    from servetune.profiles.schema import Profile

# servetune.export.classes' names, here so that --help needs no exporter import.
GATEWAY_RULES_FILE = "gateway-rules.yaml"
DEFAULT_CLASS_HEADER = "x-servetune-class"


def load_profile_arg(path: Path | None) -> Profile | None:
    """The ``--profile`` argument as a Profile document (or None)."""
    # lazy: the Profile schema adds 20 ms to every command's start-up
    from servetune.profiles.shipped import load_profile

    return None if path is None else load_profile(path)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the top-level app."""

    @app.command("export")
    def export_cmd(
        policy: Path = typer.Option(..., "--policy", help="Policy YAML (kind: Policy)."),
        engine: str = typer.Option(..., "--engine", help=f"One of: {', '.join(ENGINE_NAMES)}."),
        profile: Path | None = typer.Option(
            None, "--profile",
            help="GPU profile YAML; overrides the policy's metadata.profile (memory settings).",
        ),
        output: Path | None = typer.Option(
            None, "-o", "--output", help="Write the config here (atomically); default: stdout."
        ),
        role: str | None = typer.Option(
            None, "--role",
            help=f"One of: {', '.join(ROLES)}: the config of that instance of a disaggregated "
            "prefill/decode pair (vllm, sglang, trtllm); default: an aggregated instance.",
        ),
        class_header: str | None = typer.Option(
            None, "--class-header",
            help="The request header the gateway reads a request's class from (default: "
            f"{DEFAULT_CLASS_HEADER}), in the gateway rules.",
        ),
        class_field: str | None = typer.Option(
            None, "--class-field",
            help="Instead of a header: the JSON body field (dotted path, e.g. model or "
            "metadata.tenant) the gateway reads a request's class from.",
        ),
        gateway_rules: Path | None = typer.Option(
            None, "--gateway-rules",
            help=f"Write the gateway rules here (default: {GATEWAY_RULES_FILE} next to "
            "-o); only when the policy's per-class settings need them.",
        ),
        as_json: JsonOption = False,
    ) -> None:
        """Write POLICY as ENGINE's config file, and list what the engine cannot express.

        vllm: `vllm serve --config` YAML; sglang: `--config` YAML; trtllm:
        `--extra_llm_api_options` YAML; tgi: a shell file of launcher environment
        variables and arguments. Every policy setting the engine has no knob for is
        listed at the top of the file and on stderr, with what to do instead. With
        --role, the file also carries the engine's prefill/decode disaggregation settings
        (the KV transfer over NIXL); TGI has none.

        Per-class settings (the policy's classes: priorities, reserved and maximum seats
        and KV, chunk caps, queue caps) are no engine's: when the policy has any, the
        rules for the gateway in front of the engine are written too, as gateway-rules.yaml
        next to -o (or --gateway-rules): per class, the priority to set, the concurrency
        and queue limits, the reservation, and the replica pool to route it to.

        Example: servetune export --policy policy.yaml --engine vllm -o vllm.yaml
        """
        # lazy: the exporters and the schemas (pydantic) cost 0.15 s that --help should not pay
        from servetune.export import export_policy
        from servetune.export.classes import class_source, gateway_rules_text
        from servetune.schemas.base import document_data, load_document
        from servetune.schemas.policy import Policy

        if engine not in ENGINE_NAMES:
            raise ServetuneError(
                f"--engine {engine!r} is not supported; choose one of {', '.join(ENGINE_NAMES)}"
            )
        if role is not None and role not in ROLES:
            raise ServetuneError(
                f"--role {role!r} is not supported; choose one of {', '.join(ROLES)}"
            )
        if gateway_rules is not None and str(gateway_rules) == STDOUT:
            raise ServetuneError("--gateway-rules -: the rules cannot share stdout with the "
                                 "config; give a file path")
        class_source(class_header, class_field)  # a bad name fails before any reading
        inputs = {"--policy": policy, "--profile": profile}
        # --gateway-rules checked now too, whether or not the policy turns out to need
        # rules: the -o file given again would be written, then warned about
        check_outputs({"-o/--output": output, "--gateway-rules": gateway_rules}, inputs)
        pol = load_document(policy, Policy)
        result = export_policy(pol, engine, profile=load_profile_arg(profile), role=role,
                               class_header=class_header, class_field=class_field)
        for item in result.warnings:
            typer.echo(f"warning: {item}", err=True)
        rules = result.gateway_rules
        rules_path = gateway_rules if gateway_rules is not None else (
            output.parent / GATEWAY_RULES_FILE if output is not None else None)
        if rules is not None and output is not None:
            rules = rules.model_copy(update={"config_file": output.name})
        writes = []
        if output is not None:
            writes.append((output, lambda: write_text_atomic(output, result.text)))
        if rules is not None and rules_path is not None:
            check_outputs({"-o/--output": output, "--gateway-rules": rules_path}, inputs)
            text = gateway_rules_text(rules)
            writes.append((rules_path, lambda: write_text_atomic(rules_path, text)))
        write_all_or_none(writes)
        written_rules = rules_path if rules is not None else None
        if rules is None and rules_path is not None and rules_path.exists():
            typer.echo(f"warning: {rules_path} is left from an earlier export: policy "
                       f"{pol.name!r} needs no gateway rules; remove it", err=True)
        elif rules is None and gateway_rules is not None:
            typer.echo(f"note: policy {pol.name!r} needs no gateway rules; {gateway_rules} "
                       "not written", err=True)
        elif rules is not None and rules_path is None:
            typer.echo("note: gateway rules not written (the config went to stdout); give -o "
                       f"FILE ({GATEWAY_RULES_FILE} goes next to it) or --gateway-rules FILE",
                       err=True)
        if as_json:
            print_json(json.dumps({
                "engine": result.engine,
                "file": str(output) if output is not None else None,
                "settings": result.settings,
                "args": result.args,
                "env": result.env,
                "unsupported": result.unsupported,
                "notes": result.notes,
                "warnings": result.warnings,
                "requires": result.requires,
                "gateway_rules_file": str(written_rules) if written_rules else None,
                "gateway_rules": document_data(rules) if rules is not None else None,
            }, indent=2) + "\n")
            return
        if output is None:
            typer.echo(result.text, nl=False)
        else:
            typer.echo(f"wrote {output} ({result.engine})")
        if written_rules is not None:
            typer.echo(f"wrote {written_rules} (gateway rules)", err=output is None)
        if result.unsupported:
            typer.echo(
                f"not expressible in {engine} ({len(result.unsupported)}), do this instead:",
                err=True,
            )
            for item in result.unsupported:
                typer.echo(f"  - {item}", err=True)
