"""Run each example briefly, as a user would, so they cannot rot.

The launchers themselves (Lightning's, which starts the other ranks as processes running the script, and torchrun) are
run on the quickstart; the other examples run on the ranks of a harness pool (their ``main(argv)``, the norm demo's
``demo``), as under torchrun: each process importing torch and Lightning again would take most of the suite's time.
Each runs as in a venv of only the extras examples/README.md names for it: on the harness ranks the model libraries no
named extra brings are made absent (``helpers.not_installed``), and no example file imports one.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import logging
import math
import os
import re
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import imported_modules
from harness import run_on_ranks
from helpers import not_installed, use_existing_process_group
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
OPTIONAL = {"hf": ("transformers",), "diffusers": ("diffusers",)}
"""The model libraries beyond ``[examples]`` (Lightning, torchmetrics, TensorBoard), by the extra that brings them. Not
the optional libraries of the dependencies themselves (rich, jsonargparse, matplotlib): Lightning and torchmetrics find
those by their installed metadata and then import them, so an import blocker cannot make them absent; the README's main
job in CI runs ``train_gpt.py`` in a venv of ``[examples]`` alone."""


def _extras() -> dict[str, set[str]]:
    """Each example's extras, from the ``extras`` column of examples/README.md's table."""
    rows = [line.split("|")[1:-1] for line in (EXAMPLES / "README.md").read_text().splitlines() if line.startswith("| `")]
    header = next(line for line in (EXAMPLES / "README.md").read_text().splitlines() if line.startswith("| example"))
    column = [c.strip() for c in header.split("|")[1:-1]].index("extras")
    return {row[0].strip().strip("`"): set(re.findall(r"`(\w+)`", row[column])) for row in rows}


def absent_for(script: str) -> tuple[str, ...]:
    """The optional libraries that the extras examples/README.md names for ``script`` do not bring."""
    extras = _extras()[script]
    assert "examples" in extras, f"examples/README.md: {script} needs the examples extra"
    return tuple(root for extra, roots in OPTIONAL.items() if extra not in extras for root in roots)


def test_every_example_is_listed_with_its_extras_and_imports_no_library_they_do_not_bring():
    assert set(_extras()) == {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    for script in _extras():
        imported = {module.split(".")[0] for module, _ in imported_modules(ast.parse((EXAMPLES / script).read_text()))}
        assert not imported & set(absent_for(script)), (script, imported & set(absent_for(script)))
    assert absent_for("train_gpt.py") == ("transformers", "diffusers")
    assert absent_for("finetune_hf.py") == ("diffusers",)


_OURS = (str(EXAMPLES), str(EXAMPLES.parent / "lightning_ndclip"))
"""Where a warning is this package's or its examples' (not a dependency's installed in a virtual environment here)."""
_WARNING = re.compile(r"^(?P<file>\S+\.py):\d+: \w*Warning: .*$", re.MULTILINE)
SUMMARY = re.compile(
    r"summary: final loss (?P<loss>\S+), last grad norm (?P<norm>\S+), clip rate (?P<rate>\S+) "
    r"\((?P<clipped>\d+)/(?P<seen>\d+) steps clipped\), skipped steps (?P<skipped>\d+); "
    r"TensorBoard run: (?P<run>\S+) \(tensorboard --logdir \S+\)"
)


def _run(script: str, *args: str, cwd: Path, launcher: tuple[str, ...] = (), logged: list[str] | None = None) -> str:
    """The example's stdout; ``logged`` receives its stderr (where Lightning's ``rank_zero_info`` goes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, *launcher, str(EXAMPLES / script), *args],
        check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    ours = [m.group(0) for m in _WARNING.finditer(done.stderr) if m["file"].startswith(_OURS)]
    assert not ours, ours  # no warning from this package or its examples
    assert "returned a view tensor" not in done.stderr  # FSDP2's: a unit returning a view
    if logged is not None:
        logged.append(done.stderr)
    return done.stdout


def _main_on_rank(script: str, argv: list[str]) -> tuple[str, str]:
    """On a harness rank: the example's ``main(argv)``; its stdout and its stderr with Lightning's log records."""
    use_existing_process_group()
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    out, err = io.StringIO(), io.StringIO()
    lightning_log = logging.getLogger("lightning.pytorch")  # rank_zero_info's records (VerifyOneDevice's report)
    handler = logging.StreamHandler(err)
    lightning_log.addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with not_installed(*absent_for(script)):
                importlib.import_module(script.removesuffix(".py")).main(argv)
    finally:
        lightning_log.removeHandler(handler)
    for w in caught:
        err.write(f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}\n")
    return out.getvalue(), err.getvalue()


def _run_on_ranks(world_size: int, script: str, *args: str, logged: list[str] | None = None) -> str:
    """Rank 0's stdout of the example's ``main`` on ``world_size`` harness ranks, checked as :func:`_run` checks a
    process; ``logged`` receives rank 0's stderr."""
    out, err = run_on_ranks(world_size, _main_on_rank, script, list(args), timeout=240)[0]
    ours = [m.group(0) for m in _WARNING.finditer(err) if m["file"].startswith(_OURS)]
    assert not ours, ours  # no warning from this package or its examples
    assert "returned a view tensor" not in err  # FSDP2's: a unit returning a view
    if logged is not None:
        logged.append(err)
    return out


def _summary(out: str, steps: int) -> dict[str, float]:
    """The example's last line (the run's summary and where its TensorBoard logs are), checked."""
    summary = out.strip().splitlines()[-1]
    match = SUMMARY.fullmatch(summary)
    assert match, summary
    values = {key: float(value) for key, value in match.groupdict().items() if key != "run"}
    assert math.isfinite(values["loss"]) and math.isfinite(values["norm"]) and values["norm"] > 0
    assert values["seen"] == steps and values["clipped"] <= steps and values["skipped"] == 0
    assert abs(values["rate"] - values["clipped"] / steps) <= 0.005
    return values


def _scalars(run_dir: Path) -> dict[str, list[float]]:
    """Every scalar series of the run's one TensorBoard event file, by tag."""
    (events,) = run_dir.glob("version_0/events.out.tfevents.*")
    accumulator = EventAccumulator(str(events)).Reload()
    return {tag: [e.value for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def _norm_demo_on_rank() -> str:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), not_installed(*absent_for("norm_demo.py")):
        importlib.import_module("norm_demo").demo(2, 2, 0.25)  # the script's defaults, on the pool's 4 ranks
    return out.getvalue()


def test_norm_demo_matches_single_device():
    out = run_on_ranks(4, _norm_demo_on_rank)[0]
    error = float(re.search(r"relative error\s*:\s*(\S+)", out).group(1))
    assert error <= 1e-12
    assert re.search(r"collectives for norms \+ clip\s*:\s*1\b", out)


def test_lightning_quickstart_trains_alike_with_lightnings_launcher_and_torchrun(tmp_path):
    args = ("--max-steps", "10", "--devices", "2")
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    with ThreadPoolExecutor(2) as pool:  # the two launches at once: each spends most of its time importing
        own_run = pool.submit(_run, "lightning_quickstart.py", *args, "--logdir", str(tmp_path / "own"), cwd=tmp_path)
        elastic_run = pool.submit(
            _run, "lightning_quickstart.py", *args, "--logdir", str(tmp_path / "torchrun"), cwd=tmp_path, launcher=torchrun
        )
        own, elastic = own_run.result(), elastic_run.result()
    assert _summary(own, steps=10) == _summary(elastic, steps=10)  # seeded: the same run, whoever starts the ranks
    own_norms, elastic_norms = (_scalars(tmp_path / d / "quickstart")["grad_norm/total"] for d in ("own", "torchrun"))
    assert len(own_norms) == 2 and own_norms == elastic_norms  # logged every 5 steps


def test_train_gpt_runs_fsdp_x_tp_and_logs(tmp_path):
    args = ("--max-steps", "4", "--rows", "96", "--verify")
    logged: list[str] = []
    out = _run_on_ranks(4, "train_gpt.py", *args, "--logdir", str(tmp_path / "runs"), logged=logged)
    assert 0 < _summary(out, steps=4)["loss"] < 10  # mean cross-entropy over 64 tokens (ln 64 ≈ 4.2 at the start)
    assert "verdict: exact" in logged[0]  # VerifyOneDevice: the first step equals the model on one process
    assert "as one batch  loss" in logged[0]  # ... and the window as one batch equals its micro-batches
    assert list((tmp_path / "runs" / "gpt").glob("version_0/events.out.tfevents.*"))


def test_train_video_dit_runs_fsdp_x_context_parallel_and_logs(tmp_path):
    args = ("--max-steps", "2", "--rows", "32", "--layers", "2", "--log-every-n-steps", "1")
    out = _run_on_ranks(4, "train_video_dit.py", *args, "--logdir", str(tmp_path / "runs"))
    assert 0 < _summary(out, steps=2)["loss"] < 10  # per-clip mean squared error of a velocity of variance ~1.5
    scalars = _scalars(tmp_path / "runs" / "video_dit")
    assert len(scalars["train/loss"]) == 2 and len(scalars["grad_norm/total"]) == 2


def test_train_moe_runs_expert_parallel_and_logs_expert_and_dense_norms(tmp_path):
    args = ("--max-steps", "2", "--rows", "64", "--log-every-n-steps", "1", "--verify")
    logged: list[str] = []
    out = _run_on_ranks(4, "train_moe.py", *args, "--logdir", str(tmp_path / "runs"), logged=logged)
    assert 0 < _summary(out, steps=2)["loss"] < 10
    assert "verdict: exact" in logged[0]  # VerifyOneDevice under expert parallelism
    scalars = _scalars(tmp_path / "runs" / "moe")
    total, expert, dense = (scalars[f"grad_norm/{tag}"] for tag in ("total", "expert", "dense"))
    assert len(total) == 2 and min(expert) > 0 and min(dense) > 0
    for t, e, d in zip(total, expert, dense):  # the split is exact (TensorBoard stores float32)
        assert abs(e**2 + d**2 - t**2) <= 1e-5 * t**2


def test_finetune_hf_trains_a_transformers_moe_with_its_experts_over_ep(tmp_path):
    """The documented dp_shard=2 x cp=2 run: the MoE's experts over ep=2 (carved from dp_shard x cp), its sequences
    cut over cp, the step checked against one process."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers.PreTrainedModel, "ep_plan"):
        pytest.skip("this transformers release has no model.ep_plan")
    args = ("--dp-shard", "2", "--cp", "2", "--max-steps", "2", "--rows", "32", "--log-every-n-steps", "1", "--verify")
    logged: list[str] = []
    out = _run_on_ranks(4, "finetune_hf.py", *args, "--logdir", str(tmp_path / "runs"), logged=logged)
    assert 0 < _summary(out, steps=2)["loss"] < 10
    assert "verdict: exact" in logged[0]  # VerifyOneDevice on a transformers MoE, experts over ep
    scalars = _scalars(tmp_path / "runs" / "finetune_hf")
    assert len(scalars["grad_norm/total"]) == 2 and min(scalars["grad_norm/expert"]) > 0


def test_finetune_hf_loads_a_local_checkpoint_into_the_shards(tmp_path):
    """A checkpoint as save_pretrained writes it, built on meta and loaded by the strategy into pipeline stages on
    pp=2 x dp_shard=2 (the documented command)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "checkpoint")
    args = ("--model", str(tmp_path / "checkpoint"), "--pp", "2", "--dp-shard", "2", "--ep", "1", "--max-steps", "2")
    out = _run_on_ranks(4, "finetune_hf.py", *args, "--rows", "32", "--logdir", str(tmp_path / "runs"))
    assert 0 < _summary(out, steps=2)["loss"] < 10


def test_finetune_diffusers_cuts_a_wan_model_over_cp_and_verifies_the_first_step(tmp_path):
    """The documented dp_shard=2 x cp=2 run with --verify: the model's own plan cuts each clip over cp, and the first
    step (the noise drawn in it replayed) equals the model on one process."""
    pytest.importorskip("diffusers")
    args = ("--max-steps", "2", "--rows", "16", "--log-every-n-steps", "1", "--verify")
    logged: list[str] = []
    out = _run_on_ranks(4, "finetune_diffusers.py", *args, "--logdir", str(tmp_path / "runs"), logged=logged)
    assert 0 < _summary(out, steps=2)["loss"] < 10  # per-element squared error of a velocity of variance ~2
    assert "verdict: exact" in logged[0]
    assert len(_scalars(tmp_path / "runs" / "finetune_diffusers")["grad_norm/total"]) == 2


def test_finetune_diffusers_loads_a_local_checkpoint_into_the_shards(tmp_path):
    """A Wan as save_pretrained writes it, built on meta and loaded by the strategy into the dp_shard=2 x cp=2 shards
    (the documented --model command)."""
    diffusers = pytest.importorskip("diffusers")
    diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
        freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    ).save_pretrained(tmp_path / "transformer")  # fmt: skip
    args = ("--model", str(tmp_path / "transformer"), "--max-steps", "2", "--rows", "8", "--log-every-n-steps", "1")
    out = _run_on_ranks(4, "finetune_diffusers.py", *args, "--logdir", str(tmp_path / "runs"))
    assert 0 < _summary(out, steps=2)["loss"] < 10
