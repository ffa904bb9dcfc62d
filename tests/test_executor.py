"""The executor (serial, local processes, Ray): order, shared inputs, errors, and a plan
that comes out byte-identical whatever the backend and the worker count."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import yaml
from test_capacity_plan import write_inputs
from typer.testing import CliRunner

from servetune.cli import app
from servetune.cli.options import bare_ray_flag, executor_for
from servetune.errors import InfeasibleError, ServetuneError
from servetune.executor import (
    ProcessExecutor,
    RayExecutor,
    SerialExecutor,
    make_executor,
    ray_available,
)

runner = CliRunner()


def _scaled(shared: dict, x: int) -> tuple[int, int]:
    return x, shared["k"] * x + os.getpid() * 0  # (the pid must not matter)


def _pid(x: int) -> int:
    return os.getpid()


def _fails_on(bad: int, x: int) -> int:
    if x == bad:
        raise InfeasibleError(f"item {x} cannot be served", details={"item": x})
    return x


def test_serial_map_keeps_order_shared_and_each() -> None:
    seen: list[tuple[int, tuple[int, int]]] = []
    got = SerialExecutor().map(_scaled, [3, 1, 2], shared={"k": 10},
                               each=lambda i, r: seen.append((i, r)))
    assert got == [(3, 30), (1, 10), (2, 20)]
    assert seen == [(0, (3, 30)), (1, (1, 10)), (2, (2, 20))]
    assert SerialExecutor().map(_pid, []) == []


def test_processes_give_the_serial_results_in_order() -> None:
    items = list(range(9, -1, -1))
    want = SerialExecutor().map(_scaled, items, shared={"k": 7})
    seen: list[int] = []
    with ProcessExecutor(2) as ex:
        got = ex.map(_scaled, items, shared={"k": 7}, each=lambda i, r: seen.append(i))
        # a second map with other shared inputs: the workers must not reuse the first's
        again = ex.map(_scaled, items, shared={"k": -1})
        pids = set(ex.map(_pid, range(8)))
    assert got == want and seen == list(range(10))
    assert again == [(x, -x) for x in items]
    # the work left this process (the first item of the first map runs here, to warm
    # the compile cache; the rest went to the pool)
    assert pids - {os.getpid()}


def test_a_worker_error_reaches_the_caller_whole() -> None:
    with ProcessExecutor(2) as ex, pytest.raises(InfeasibleError) as info:
        ex.map(functools.partial(_fails_on, 3), range(6))
    assert info.value.message == "item 3 cannot be served"
    assert info.value.details == {"item": 3} and info.value.exit_code == 3


def _slow(folder: str, x: int) -> int:
    import time

    Path(folder, f"started-{x}").touch()
    time.sleep(0.2 if x == 0 else 30)
    Path(folder, f"finished-{x}").touch()
    return x


def test_an_error_in_the_caller_ends_the_work_in_flight(tmp_path: Path) -> None:
    """Ctrl-C (or any error) while a map waits drops the tasks in flight: the pool's
    processes end at once instead of finishing a long task first."""

    def stop(i: int, _result: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), ProcessExecutor(2) as ex:
        ex.map(functools.partial(_slow, str(tmp_path)), range(3), each=stop)
    # item 0 ran here and was reported; the workers' items were ended, never finished
    assert (tmp_path / "finished-0").exists()
    assert not (tmp_path / "finished-1").exists() and not (tmp_path / "finished-2").exists()


def test_make_executor_and_the_cli_options(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_executor(1), SerialExecutor)
    ex = make_executor(3)
    assert isinstance(ex, ProcessExecutor) and ex.workers == 3
    ex.close()  # never started: nothing to stop
    with pytest.raises(ServetuneError, match="--workers"):
        ProcessExecutor(0)
    monkeypatch.setenv("SERVETUNE_WORKERS", "2")
    ex = executor_for(None, None)
    assert isinstance(ex, ProcessExecutor) and ex.workers == 2
    assert isinstance(executor_for(1, None), SerialExecutor)  # the flag wins
    for bad in ("two", "0"):
        monkeypatch.setenv("SERVETUNE_WORKERS", bad)
        with pytest.raises(ServetuneError, match="SERVETUNE_WORKERS"):
            executor_for(None, None)
    assert bare_ray_flag(["plan", "--ray"]) == ["plan", "--ray=local"]
    assert bare_ray_flag(["plan", "--ray", "-q"]) == ["plan", "--ray=local", "-q"]
    assert bare_ray_flag(["plan", "--ray", "auto", "-q"]) == ["plan", "--ray", "auto", "-q"]


def test_ray_missing_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *a, **kw):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("no ray")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ServetuneError, match=r"pip install 'servetune\[ray\]'"):
        RayExecutor("local", 2)


@pytest.mark.skipif(not ray_available(), reason="ray is not installed (extra `ray`)")
def test_an_unreachable_ray_address_is_one_quick_error() -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on: bind, then let it go
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(ServetuneError, match=f"nothing answers at 127.0.0.1:{port}"):
            RayExecutor(address, 2)


# ----------------------------------------------------------------- a plan on every backend
# test_capacity_plan's two GPU types and its day forecast: capacities, validation,
# single-type plans and a growth sweep all have several independent items.

def _plan(inp: dict[str, Path], out: Path, cache: Path, *backend: str) -> bytes:
    r = runner.invoke(app, [
        "plan", "--workload", str(inp["workload"]), "--forecast", str(inp["day"]),
        "--fleet", str(inp["fleet"]), "--slo", str(inp["slo"]), "-o", str(out),
        "--cache-dir", str(cache), "--capacity-method", "candidates",
        "--prompt-edges", "2048", "--output-edges", "128", "--growth", "1,2", "-q",
        *backend,
    ])
    assert r.exit_code == 0, r.output
    return out.read_bytes()


def test_plan_is_byte_identical_serial_and_on_two_processes(tmp_path: Path) -> None:
    # (with every candidate policy: a worker process does not see a test's monkeypatch)
    inp = write_inputs(tmp_path)
    serial = _plan(inp, tmp_path / "serial.yaml", tmp_path / "c1", "--workers", "1")
    two = _plan(inp, tmp_path / "two.yaml", tmp_path / "c2", "--workers", "2")
    assert two == serial
    plan = yaml.safe_load(serial)
    assert [row["growth"] for row in plan["growth_sweep"]] == [1.0, 2.0]
    # the capacities measured on processes were cached as the serial run's were
    assert sorted(p.name for p in (tmp_path / "c1").iterdir()) == sorted(
        p.name for p in (tmp_path / "c2").iterdir())


@pytest.mark.skipif(not ray_available(), reason="ray is not installed (extra `ray`)")
def test_plan_is_byte_identical_on_ray(tmp_path: Path) -> None:
    inp = write_inputs(tmp_path)
    serial = _plan(inp, tmp_path / "serial.yaml", tmp_path / "c1", "--workers", "1")
    on_ray = _plan(inp, tmp_path / "ray.yaml", tmp_path / "c2", "--ray", "local",
                   "--workers", "2")
    assert on_ray == serial


def test_goodput_seeds_side_by_side_give_the_serial_json(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[1]
    args = ["goodput", "--workload", str(repo / "configs/workloads/azure-conv-2023.yaml"),
            "--requests", "150", "--seeds", "3", "--profile", "h200-llama-3.1-8b",
            "--policy", str(repo / "configs/policies/vllm-serve-defaults.yaml"),
            "--slo", str(repo / "configs/slos/mlperf-llama-3.1-8b-interactive.yaml"),
            "--tolerance", "0.1", "-q"]
    outs = []
    for n in ("1", "2"):
        out = tmp_path / f"goodput-{n}.json"
        r = runner.invoke(app, [*args, "--workers", n, "--json-out", str(out)])
        assert r.exit_code in (0, 3), r.output
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    data = yaml.safe_load(outs[0])  # (JSON is YAML)
    assert [s["seed"] for s in data["points"][0]["seeds"]] == [0, 1, 2]
