"""``profile measure`` end to end without a GPU: the measurement code runs on the CPU with a
tiny architecture and small shapes (``device="cpu"``, perf_counter timing, eager steps),
its CSVs are checked against the format ``profile fit`` reads, and the real fit turns them
into a Profile. Only the CUDA timing itself (events, graph capture) is not exercised here.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from servetune.cli import app
from servetune.errors import ServetuneError
from servetune.profiles.measurements import PER_OP_FILES, STEP_COLUMNS, load_measurements, step_rows
from servetune.profiles.schema import ModelArch
from servetune.profiles.shipped import load_profile

torch = pytest.importorskip("torch", reason="needs PyTorch (the optional 'gpu' extra)")

from servetune.profiles.measure import MeasureGrid, measure  # noqa: E402

H200_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "gpu_measurements" / "h200"

TINY = ModelArch(name="tiny-llama", layers=2, hidden=64, intermediate=192, heads=4,
                 kv_heads=2, head_dim=16, vocab=512, params=200_000, dtype="bf16")
GRID = MeasureGrid(
    gemm_tokens=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    prefill_tokens=(16, 32, 64, 128),
    chunks=((64, 16), (128, 32)),
    decode_batch=(1, 2, 4, 8),
    decode_context=(16, 64, 256),
    decode_max_kv_tokens=1024,  # drops (8, 256)
    lm_rows=(1, 4, 16, 64),
    step_decode=(0, 1, 4, 16),
    step_context=(32, 128),
    step_chunk=(0, 32, 128),
    step_extra=((0, 32, 64), (4, 128, 16), (1, 32, 32)),  # the last is already in the grid
)
# the headers of gpu_measurements/h200 (what the shipped profiles were fitted from)
HEADERS = {
    "linear.csv": ["model", "op", "tokens", "k", "n", "dtype", "ms", "tflops"],
    "elementwise.csv": ["model", "tokens", "ms"],
    "attn_prefill.csv": ["model", "batch", "tokens", "ms"],
    "attn_decode.csv": ["model", "batch", "context", "ms", "kv_GBps"],
    "lm_head.csv": ["model", "tokens", "vocab", "ms"],
    "step_graph_tiny-llama.csv": ["model", "decode_seqs", "context", "prefill_tokens",
                                  "graph_ms", "eager_ms"],
}
ROWS = {
    "linear.csv": 4 * 9,  # qkv, o, gate_up, down at 9 token counts
    "elementwise.csv": 9,
    "attn_prefill.csv": 4 + 2,  # causal prefills + chunk_prefix rows
    "attn_decode.csv": 4 * 3 - 1,
    "lm_head.csv": 4,
    # chunk 0: 3 decode sizes x 2 contexts; chunks 32 and 128: the same 6 plus prefill only;
    # two new extra shapes
    "step_graph_tiny-llama.csv": 6 + 7 + 7 + 2,
}


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("measured") / "cpu"
    threads = torch.get_num_threads()
    written = measure(out, models=[TINY], device="cpu", grid=GRID, log=lambda m: None)
    assert torch.get_num_threads() == threads  # the one-thread CPU timing is undone
    assert sorted(p.name for p in written) == sorted([*HEADERS, "env.txt"])
    return out


def test_csvs_have_the_columns_and_rows_fit_reads(measured):
    for name, header in HEADERS.items():
        columns, rows = _read(measured / name)
        assert columns == header, name
        assert len(rows) == ROWS[name], name
        assert {r["model"] for r in rows} == {"tiny-llama"}
        assert all(float(r["ms"] if "ms" in r else r["graph_ms"]) > 0 for r in rows), name
        required = PER_OP_FILES.get(name, STEP_COLUMNS)
        assert set(required) <= set(columns)
    if H200_DIR.is_dir():  # the same format as the shared H200 measurements
        for name, header in HEADERS.items():
            ref = "step_graph_llama-3.1-8b.csv" if name.startswith("step_graph") else name
            assert _read(H200_DIR / ref)[0] == header


def test_rows_have_the_architecture_shapes(measured):
    _, lin = _read(measured / "linear.csv")
    h, q, kv, hd, inter = 64, 4, 2, 16, 192
    want = {"qkv": (h, (q + 2 * kv) * hd), "o": (q * hd, h), "gate_up": (h, 2 * inter),
            "down": (inter, h)}
    for r in lin:
        assert (int(r["k"]), int(r["n"])) == want[r["op"]]
        assert r["dtype"] == "bf16"
    assert sorted({int(r["tokens"]) for r in lin}) == list(GRID.gemm_tokens)
    _, dec = _read(measured / "attn_decode.csv")
    assert all(int(r["batch"]) * int(r["context"]) <= 1024 for r in dec)
    _, pre = _read(measured / "attn_prefill.csv")
    assert [r["batch"] for r in pre][-2:] == ["chunk_prefix64", "chunk_prefix128"]
    _, lm = _read(measured / "lm_head.csv")
    assert {r["vocab"] for r in lm} == {"512"}
    meas = load_measurements(measured)
    steps = step_rows(meas.steps["tiny-llama"], "tiny-llama")
    assert {(s.decode_seqs, s.prefill_tokens) for s in steps if s.decode_seqs == 0} == {
        (0, 32), (0, 128), (0, 64)}
    assert all(s.context == 0 for s in steps if s.decode_seqs == 0)
    # CPU timings must not pass for a GPU: env.txt names none
    env = (measured / "env.txt").read_text()
    assert env.splitlines()[1].startswith("device cpu sms ")


def test_fit_turns_the_measurements_into_a_profile(measured, tmp_path):
    arch_file = tmp_path / "tiny.yaml"
    arch_file.write_text(yaml.safe_dump(TINY.model_dump()))
    out = tmp_path / "tiny.yaml.profile.yaml"
    runner = CliRunner()
    res = runner.invoke(app, ["profile", "fit", "--measurements", str(measured), "--model",
                              str(arch_file), "--gpu", "h200", "-o", str(out)])
    assert res.exit_code == 0, res.output
    profile = load_profile(out)
    assert profile.model.name == "tiny-llama"
    assert profile.calibration.kind == "measured"
    assert profile.calibration.fit["step_rows"] == ROWS["step_graph_tiny-llama.csv"]
    assert len(profile.calibration.files) == 6
    st = profile.step_time
    tokens = [1, 2, 8, 32, 128, 512, 2048, 8192]
    decode = [st.seconds(t, t, t, 64 * t, 0) for t in tokens]
    prefill = [st.seconds(t, 1, 0, 0, t * t / 2) for t in tokens]
    for times in (decode, prefill):
        assert all(s > 0 for s in times)
        assert all(b >= a for a, b in zip(times, times[1:], strict=False))


def test_fit_without_gpu_name_needs_gpu_option(measured, tmp_path):
    arch_file = tmp_path / "tiny.yaml"
    arch_file.write_text(yaml.safe_dump(TINY.model_dump()))
    res = CliRunner().invoke(app, ["profile", "fit", "--measurements", str(measured),
                                   "--model", str(arch_file), "-o", str(tmp_path / "p.yaml")])
    assert res.exit_code == 2
    assert "env.txt" in res.output and "--gpu" in res.output
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_measure_refuses_without_cuda(tmp_path):
    with pytest.raises(ServetuneError, match="CUDA"):
        measure(tmp_path / "out", models=[TINY], grid=GRID)
    assert not (tmp_path / "out").exists()
    res = CliRunner().invoke(app, ["profile", "measure", "-o", str(tmp_path / "out")])
    assert res.exit_code == 2 and "CUDA" in res.output
    assert not (tmp_path / "out").exists()


def test_torch_version_parsing():
    from servetune.profiles.measure import _version

    assert _version("2.13.0+cpu") == (2, 13)
    assert _version("2.4.1") < (2, 5) <= _version("2.5.0a0+git1234")


def test_bad_arguments_are_one_line_errors(tmp_path):
    with pytest.raises(ServetuneError, match="device 'tpu'"):
        measure(tmp_path / "o", models=[TINY], device="tpu")
    with pytest.raises(ServetuneError, match="unknown"):
        measure(tmp_path / "o", models=["no-such-model"], device="cpu")
    fp8 = TINY.model_copy(update={"dtype": "fp8"})
    with pytest.raises(ServetuneError, match="bf16"):
        measure(tmp_path / "o", models=[fp8], device="cpu", grid=GRID)
    assert not (tmp_path / "o").exists()


def test_kv_budget_drops_the_shapes_that_do_not_fit(tmp_path, monkeypatch):
    from servetune import profile_measure

    # 0.6 * budget / (2 layers * 2 kv heads * 16 dims * 2 (K, V) * 2 bytes) = 600 tokens
    monkeypatch.setattr(profile_measure, "CPU_KV_BUDGET_BYTES", 256_000)
    grid = MeasureGrid(gemm_tokens=(1, 8), prefill_tokens=(16,), chunks=(), decode_batch=(1,),
                       decode_context=(16,), lm_rows=(1, 4), step_decode=(0, 1, 4, 16),
                       step_context=(32, 128), step_chunk=(0, 32), step_extra=())
    measure(tmp_path, models=[TINY], device="cpu", grid=grid, log=lambda m: None)
    _, rows = _read(tmp_path / "step_graph_tiny-llama.csv")
    shapes = [(int(r["decode_seqs"]), int(r["context"]), int(r["prefill_tokens"])) for r in rows]
    # 16 x 128 = 2048 cached tokens per layer is over the 600-token budget, 16 x 32 is not
    assert shapes == [(1, 32, 0), (1, 128, 0), (4, 32, 0), (4, 128, 0), (16, 32, 0),
                      (0, 0, 32), (1, 32, 32), (1, 128, 32), (4, 32, 32), (4, 128, 32),
                      (16, 32, 32)]


def test_gpu_grid_covers_the_shipped_h200_steps():
    """The default shapes are those of scripts/step_graph.py behind gpu_measurements/h200."""
    if not H200_DIR.is_dir():
        pytest.skip(f"shared measurements not found at {H200_DIR}")
    from servetune.profiles.measure import GPU_GRID

    _, rows = _read(H200_DIR / "step_graph_llama-3.1-8b.csv")
    shapes = GPU_GRID.step_shapes()
    assert len(shapes) == len(set(shapes))
    for r in rows:
        d, c, p = int(r["decode_seqs"]), int(r["context"]), int(r["prefill_tokens"])
        assert (d, c or 512, p) in shapes, r
