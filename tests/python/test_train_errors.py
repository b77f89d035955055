"""The training demo's errors (input checked before any work): every bad input ends as one line
`fp8dp.train: error: <key or file>: expected ..., got ...` and exit code 2, never a traceback; a
resume of a finished run is a no-op that says so.

The tests call fp8dp.train's main() in this process (a world of one rank on gloo, as
`python -m fp8dp.train` without torchrun) on a model of one layer x 16, two steps.

Evidence that each test catches its defect (2026-12-01, each fix reverted alone, then restored):
- test_resume_of_a_finished_run_is_a_no_op: with the `if rank == 0 and summary["start_step"] ==
  summary["steps"]` branch in __main__.main made `if False`, `TypeError: unsupported format
  string passed to NoneType.__format__` (main() formats the last validation loss, which no step
  computed): the original report. With the `if start == t.steps:` early return removed from
  loop.train, "the finished run's summary or metrics changed" (summary.json rewritten with null
  losses).
- test_resume_past_train_steps_names_train_steps: with the `if start > t.steps:` check removed
  from loop.train, the same TypeError.
- test_bad_config_file: with load_config's `except yaml.YAMLError` removed, [garbage-yaml] fails
  with `yaml.parser.ParserError: while parsing a flow sequence ...` (a traceback, four lines of
  message); without `except OSError`, [missing] prints `[Errno 2] No such file or directory: ...`
  (not the `<file>: expected ..., got ...` form); without `except UnicodeDecodeError`, [binary]
  prints `'utf-8' codec can't decode byte 0xff ...`, naming no file.
- test_bad_override: with `math.isfinite(v)` removed from config._num, train.lr=.inf and
  train.weight_decay=.inf start training and fail in the first step with `RuntimeError:
  check_for_nan_in_grad: rank 0 has NaN or Inf ...` (a traceback). fp8.margin is checked by the
  recipe itself (fp8dp.DelayedScaling) and named with its section by config._library_error: with
  that prefix removed, fp8.margin=.inf and =2000 are reported as `margin: expected ...`, not
  `fp8.margin` (test_train_config_library.py). With config.py as it was (1a0ce06), all 6 cases
  fail.
- test_bad_checkpoint: with checkpoint.py as it was (1a0ce06), all 13 cases fail: the corrupt
  meta.json is `Unterminated string starting at: line 1 column 13 (char 12)` naming no file,
  the missing key `KeyError: 'world_size'`, a list or int config `TypeError`/`AttributeError`,
  the truncated rank file `RuntimeError: PytorchStreamReader failed reading zip archive`, a
  missing rank file `FileNotFoundError`, a rank file without 'model' `KeyError: 'model'`, the
  torn checkpoint (meta.json's step != the rank file's) and a non-integer step resume silently
  (exit 0), a bad model state dict is a multi-line RuntimeError traceback, a bad RNG state
  `TypeError: expected a torch.ByteTensor`.

- test_checkpoint_from_before_the_parallel_section_resumes: without the parallel section's
  defaults in checkpoint._read_and_check, `parallel.pipeline_parallel_size: expected None (the
  checkpoint ... was trained with it ...), got 1`.
- test_compare_bf16_misuse: with __main__.py as it was (1a0ce06), `SystemExit: --compare-bf16
  trains two runs; use --save/--resume without it`.

Checked by hand, not here (it needs two processes): under torchrun with 2 ranks and only
rank001.pt truncated, rank 0 prints `fp8dp.train: error: .../rank001.pt: expected a checkpoint
written by fp8dp.train, got a truncated or corrupt file (...)` and both ranks exit; before, only
rank 0 printed errors, so rank 1's error was a traceback and rank 0 said nothing.
"""

import io
import json
import shutil
import socket
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ERROR = "fp8dp.train: error: "


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_config(tmp: Path) -> Path:
    path = tmp / "tiny.yaml"
    path.write_text(
        "model: {n_layer: 1, d_model: 16, n_head: 1, seq_len: 16}\n"
        "train: {steps: 2, global_batch_size: 2, micro_batch_size: 1, warmup_steps: 1,\n"
        "        eval_every: 1, eval_batches: 1}\n"
        "ddp: {bucket_size: null}\n"
        f"data: {{path: {REPO / 'data' / 'shakespeare.txt'}}}\n"
        f"out: {{dir: {tmp / 'run'}}}\n"
    )
    return path


def run(*argv):
    """main(argv) as a world of one on a free port; returns (exit code, stdout, stderr)."""
    from fp8dp.train.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        # What setup_distributed sets for a run without torchrun, set here so that it is undone.
        for k, v in dict(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        ).items():
            mp.setenv(k, v)
        with redirect_stdout(out), redirect_stderr(err):
            # --device cpu: the same gloo world of one on a GPU machine (no rank beyond the GPUs)
            rc = main([str(a) for a in argv] + ["--no-progress", "--device", "cpu"])
    return rc, out.getvalue(), err.getvalue()


def assert_one_error(rc, err, *parts):
    """Exit code 2 and exactly one error line, which holds every part in order."""
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.startswith(ERROR)]
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0][len(ERROR) :]
    pos = 0
    for part in parts:
        found = line.find(part, pos)
        assert found >= 0, f"{part!r} not in {line!r}"
        pos = found + len(part)
    return line


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-step run and its checkpoint (saved once for the module)."""
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    tmp = tmp_path_factory.mktemp("demo")
    cfg = _tiny_config(tmp)
    rc, out, err = run("--config", cfg, "--save", tmp / "ckpt")
    assert rc == 0, err
    return cfg, tmp / "ckpt"


@pytest.fixture(autouse=True)
def _release(fp8_states_released):
    yield


def test_resume_of_a_finished_run_is_a_no_op(finished):
    cfg, ckpt = finished
    run_dir = ckpt.parent / "run" / "fp8"
    before = {name: (run_dir / name).read_text() for name in ("summary.json", "metrics.jsonl")}
    rc, out, err = run("--config", cfg, "--resume", ckpt)
    assert rc == 0, err
    assert f"the checkpoint in {ckpt} is at step 2 = train.steps, nothing to train" in out, out
    after = {name: (run_dir / name).read_text() for name in before}
    assert after == before, "the finished run's summary or metrics changed"


def test_resume_past_train_steps_names_train_steps(finished):
    cfg, ckpt = finished
    rc, _, err = run("--config", cfg, "--resume", ckpt, "--set", "train.steps=1")
    assert_one_error(
        rc, err, f"train.steps: expected >= 2 (the step of the checkpoint in {ckpt})", "got 1"
    )


@pytest.mark.parametrize(
    "text, parts",
    [
        ("model: [1, 2\ntrain: {}\n", ["expected YAML, got ", "(line 2, column 6)"]),
        ("\xff\xfe", ["expected UTF-8 YAML text, got byte 0xff at offset 0"]),
        (None, ["expected a readable YAML file, got No such file or directory"]),
    ],
    ids=["garbage-yaml", "binary", "missing"],
)
def test_bad_config_file(tmp_path, text, parts):
    path = tmp_path / "bad.yaml"
    if text is not None:
        path.write_bytes(text.encode("latin-1"))
    rc, _, err = run("--config", path)
    assert_one_error(rc, err, f"{path}: ", *parts)


@pytest.mark.parametrize(
    "override, parts",
    [
        ("train.lr=.inf", ["train.lr: expected a finite number > 0.0, got inf"]),
        ("train.lr=.nan", ["train.lr: expected a finite number > 0.0, got nan"]),
        (
            "train.weight_decay=.inf",
            ["train.weight_decay: expected a finite number >= 0.0, got inf"],
        ),
        ("fp8.margin=.inf", ["fp8.margin: expected a finite number >= 0 and <= 14.807", "got inf"]),
        (
            "fp8.margin=2000",
            ["fp8.margin: expected a finite number >= 0 and <= 14.807", "got 2000"],
        ),
        ("train.lr=[1", ["--set train.lr: expected a YAML value, got '[1' ("]),
        ("train.cuda_graphs=1", ["train.cuda_graphs: expected true or false, got 1"]),
        # run() forces --device cpu: refused before the first step
        ("train.cuda_graphs=true", ["train.cuda_graphs: needs a CUDA device, got cpu"]),
        (
            "train.cuda_graphs=true train.fp8_stats_every=1",
            ["train.cuda_graphs: expected false with train.fp8_stats_every > 0"],
        ),
        (
            "train.cuda_graphs=true parallel.pipeline_parallel_size=2",
            ["train.cuda_graphs: expected false with parallel.pipeline_parallel_size > 1"],
        ),
    ],
)
def test_bad_override(finished, override, parts):
    cfg, _ = finished
    sets = [a for o in override.split(" ") for a in ("--set", o)]  # several, space-separated
    rc, _, err = run("--config", cfg, *sets)
    assert_one_error(rc, err, *parts)


def _corrupt_meta(text):
    def f(ckpt):
        (ckpt / "meta.json").write_text(text)

    return f


def _edit_meta(fn):
    def f(ckpt):
        meta = json.loads((ckpt / "meta.json").read_text())
        fn(meta)
        (ckpt / "meta.json").write_text(json.dumps(meta))

    return f


def _truncate_rank_file(ckpt):
    data = (ckpt / "rank000.pt").read_bytes()
    (ckpt / "rank000.pt").write_bytes(data[: len(data) // 2])


def _edit_rank_file(fn):
    def f(ckpt):
        state = torch.load(ckpt / "rank000.pt", weights_only=False)
        fn(state)
        torch.save(state, ckpt / "rank000.pt")

    return f


CHECKPOINT_CASES = {
    "meta-not-json": (
        _corrupt_meta('{"step": 2, "world_'),
        ["meta.json: expected JSON written by fp8dp.train, got a parse error at " "line 1, column"],
    ),
    "meta-not-object": (
        _corrupt_meta("[2, 1]"),
        ["meta.json: expected a JSON object with keys config, step and " "world_size, got list"],
    ),
    "meta-no-world_size": (
        _edit_meta(lambda m: m.pop("world_size")),
        ["meta.json: expected key 'world_size' (an integer >= 1), got keys " "['config', 'step']"],
    ),
    # Worded before this issue; tests/distributed/test_train_demo.py matches it as it is.
    "meta-world-size": (
        _edit_meta(lambda m: m.__setitem__("world_size", 2)),
        [
            "--resume: the checkpoint was written by 2 ranks and resumes exactly "
            "only at the same world size, got 1"
        ],
    ),
    "meta-bad-step": (
        _edit_meta(lambda m: m.__setitem__("step", "two")),
        ["meta.json: step: expected an integer >= 0, got 'two'"],
    ),
    "meta-bad-config": (
        _edit_meta(lambda m: m.__setitem__("config", 3)),
        ["meta.json: config: expected an object (the run's config), got 3"],
    ),
    "no-meta": (
        lambda ckpt: (ckpt / "meta.json").unlink(),
        [
            "--resume ",
            ": expected a checkpoint directory (with meta.json), got a "
            "directory without meta.json",
        ],
    ),
    "rank-file-truncated": (
        _truncate_rank_file,
        [
            "rank000.pt: expected a checkpoint written by fp8dp.train, got a "
            "truncated or corrupt file (torch.load: "
        ],
    ),
    "rank-file-missing": (
        lambda ckpt: (ckpt / "rank000.pt").unlink(),
        ["rank000.pt: expected rank 0's checkpoint file, got none"],
    ),
    "rank-file-no-model": (
        _edit_rank_file(lambda s: s.pop("model")),
        ["rank000.pt: expected keys ['model', 'optimizer', 'rng', 'step'], " "got no ['model']"],
    ),
    "rank-file-torn": (
        _edit_meta(lambda m: m.__setitem__("step", 1)),
        ["rank000.pt: step: expected 1 (meta.json's), got 2"],
    ),
    "rank-file-bad-model": (
        _edit_rank_file(lambda s: s["model"].pop(next(iter(s["model"])))),
        [
            "rank000.pt: model: expected this model's state dict, got "
            "Error(s) in loading state_dict"
        ],
    ),
    "rank-file-short-master": (
        _edit_rank_file(lambda s: s["optimizer"]["masters"].__setitem__(0, torch.zeros(1))),
        [
            "rank000.pt: optimizer state_dict['masters'][0]: expected ",
            "elements (float32), got 1 (float32, shape [1])",
        ],
    ),
    "rank-file-bad-rng": (
        _edit_rank_file(lambda s: s["rng"].__setitem__("torch", None)),
        ["rank000.pt: rng: expected the torch, cuda and python RNG states"],
    ),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_bad_checkpoint(finished, tmp_path, case):
    cfg, ckpt = finished
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    corrupt, parts = CHECKPOINT_CASES[case]
    corrupt(bad)
    rc, _, err = run("--config", cfg, "--resume", bad, "--set", "train.steps=3")
    assert_one_error(rc, err, *parts)


def test_compare_bf16_misuse(finished, tmp_path):
    """Was `raise SystemExit("...")`: exit code 1 and a message without the error prefix."""
    cfg, _ = finished
    rc, _, err = run("--config", cfg, "--compare-bf16", "--save", tmp_path)
    assert_one_error(
        rc,
        err,
        "--compare-bf16: expected no --save or --resume (it trains two " "runs), got --save",
    )
    rc, _, err = run("--config", cfg, "--compare-bf16", "--set", "fp8.enabled=false")
    assert_one_error(rc, err, "--compare-bf16: expected a config with fp8.enabled true, got false")


def test_checkpoint_from_before_the_parallel_section_resumes(finished, tmp_path):
    # A checkpoint's meta.json written before parallel.* existed (a data-parallel run) matches
    # the section's defaults; one that names another layout is refused, naming the key.
    cfg, ckpt = finished
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["config"]["parallel"]
    (old / "meta.json").write_text(json.dumps(meta))
    rc, out, err = run("--config", cfg, "--resume", old)
    assert rc == 0, err
    assert "nothing to train" in out, out
    rc, _, err = run(
        "--config", cfg, "--resume", ckpt, "--set", "parallel.schedule=interleaved_1f1b"
    )
    assert_one_error(rc, err, "parallel.schedule: expected '1f1b'", "got 'interleaved_1f1b'")
