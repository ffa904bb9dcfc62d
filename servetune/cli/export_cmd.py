"""CLI: ``servetune export``: a policy as an engine's config file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from servetune.cli.options import JsonOption, print_json
from servetune.engines import DISAGG_ROLES as ROLES
from servetune.engines import ENGINE_NAMES as ENGINES
from servetune.errors import ServetuneError
from servetune.io import check_outputs, write_text_atomic

if TYPE_CHECKING:  # imported where used: see the lazy imports
    from servetune.schemas.profile import Profile


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
        engine: str = typer.Option(..., "--engine", help=f"One of: {', '.join(ENGINES)}."),
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
        as_json: JsonOption = False,
    ) -> None:
        """Write POLICY as ENGINE's config file, and list what the engine cannot express.

        vllm: `vllm serve --config` YAML; sglang: `--config` YAML; trtllm:
        `--extra_llm_api_options` YAML; tgi: a shell file of launcher environment
        variables and arguments. Every policy setting the engine has no knob for is
        listed at the top of the file and on stderr, with what to do instead. With
        --role, the file also carries the engine's prefill/decode disaggregation settings
        (the KV transfer over NIXL); TGI has none.

        Example: servetune export --policy policy.yaml --engine vllm -o vllm.yaml
        """
        # lazy: the exporters and the schemas (pydantic) cost 0.15 s that --help should not pay
        from servetune.export import export_policy
        from servetune.schemas.base import load_document
        from servetune.schemas.policy import Policy

        if engine not in ENGINES:
            raise ServetuneError(
                f"--engine {engine!r} is not supported; choose one of {', '.join(ENGINES)}"
            )
        if role is not None and role not in ROLES:
            raise ServetuneError(
                f"--role {role!r} is not supported; choose one of {', '.join(ROLES)}"
            )
        check_outputs({"-o/--output": output}, {"--policy": policy, "--profile": profile})
        pol = load_document(policy, Policy)
        result = export_policy(pol, engine, profile=load_profile_arg(profile), role=role)
        for item in result.warnings:
            typer.echo(f"warning: {item}", err=True)
        if output is not None:
            write_text_atomic(output, result.text)
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
            }, indent=2) + "\n")
            return
        if output is None:
            typer.echo(result.text, nl=False)
        else:
            typer.echo(f"wrote {output} ({result.engine})")
        if result.unsupported:
            typer.echo(
                f"not expressible in {engine} ({len(result.unsupported)}), do this instead:",
                err=True,
            )
            for item in result.unsupported:
                typer.echo(f"  - {item}", err=True)
