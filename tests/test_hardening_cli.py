"""The command line: every bad flag value gets exit status 2 and a message naming the flag;
flags are spelled one way everywhere (old spellings kept as aliases); output files may go into
directories that do not exist yet; output that is not a terminal is never cut short."""

import json
import re
from pathlib import Path

import pytest

from h2jax.cli import build_parser
from h2jax.cli import main as cli_main
from h2jax.speedup import parse_tokens

REPO = Path(__file__).resolve().parent.parent
DEMO_PLAN = str(REPO / "plans" / "demo.json")
EMU2 = str(REPO / "plans" / "cluster-emu-2type.toml")
C64 = str(REPO / "plans" / "cluster-64.toml")


def _cli(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = cli_main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


FLAG_CASES = [
    (["profile", "--chips", "cpu", "--seq-len", "0", "--out", "x.json"], "--seq-len"),
    (["compare", "--cluster", C64, "--model", "llama-7b", "--seq-len", "0", "--global-batch-tokens", "2M"], "--seq-len"),
    (["compare", "--cluster", C64, "--model", "llama-7b", "--seq-len", "2048", "--global-batch-tokens", "2X"],
     "--global-batch-tokens"),
    (["compare", "--cluster", C64, "--model", "llama-7b", "--seq-len", "2048", "--global-batch-tokens", "2M",
      "--baseline-global-batch-tokens", "0"], "--baseline-global-batch-tokens"),
    (["plan", "--cluster", EMU2, "--model", "tiny", "--seq-len", "16", "--global-batch-tokens", "lots"],
     "--global-batch-tokens"),
    (["plan", "--cluster", EMU2, "--model", "tiny", "--seq-len", "16", "--global-batch-tokens", "0.001K"],
     "--global-batch-tokens"),
    (["plan", "--cluster", EMU2, "--model", "tiny", "--seq-len", "16", "--global-batch", "0"], "--global-batch"),
    (["plan", "--cluster", EMU2, "--model", "tiny", "--seq-len", "16", "--global-batch", "8", "--prove-two-shapes",
      "--jobs", "0"], "--jobs"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--baseline-steps", "0"], "--baseline-steps"),
    (["demo", "--seq-len", "-3"], "--seq-len"),
    (["simulate", "--plan", DEMO_PLAN, "--jitter", "-5"], "--jitter"),
    (["simulate", "--plan", DEMO_PLAN, "--jitter", "nan"], "--jitter"),
    (["simulate", "--plan", DEMO_PLAN, "--micro-batches", "0"], "--micro-batches"),
    (["align", "--chips", "cpu", "--batch", "0"], "--batch"),
    (["align", "--chips", "cpu", "--steps", "0"], "--steps"),
    (["align", "--chips", "cpu", "--learning-rate", "inf"], "--learning-rate"),
    (["run", "--plan", DEMO_PLAN, "--steps", "0"], "--steps"),
]


@pytest.mark.parametrize("argv, flag", FLAG_CASES, ids=[" ".join(c[0][:1] + c[0][-2:]) for c in FLAG_CASES])
def test_a_bad_flag_value_exits_2_naming_the_flag(argv, flag, capsys):
    rc, _, err = _cli(argv, capsys)
    assert rc == 2, err
    assert flag in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv", [["run", "--plan", DEMO_PLAN, "--data", "{tmp}/missing.u8"],
                                  ["run", "--plan", DEMO_PLAN, "--data", "{tmp}/empty.u8"],
                                  ["run", "--plan", DEMO_PLAN, "--data", "{tmp}/short.u8"]],
                         ids=["missing", "empty", "too-short"])
def test_run_with_bad_data_is_one_error_naming_data(argv, tmp_path, capsys):
    (tmp_path / "empty.u8").write_bytes(b"")
    (tmp_path / "short.u8").write_bytes(b"x" * 10)  # the demo plan's seq_len is 64
    rc, _, err = _cli([a.format(tmp=tmp_path) for a in argv], capsys)
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--data" in lines[0] and "Traceback" not in err, err


def test_token_counts_take_binary_suffixes_exactly():
    assert parse_tokens("2M") == 2 * 2**20 == parse_tokens("2097152") == parse_tokens("2048K")
    assert parse_tokens("1.5K") == 1536 and parse_tokens("0.125K") == 128
    assert parse_tokens(str(10**20 + 1)) == 10**20 + 1  # no float rounding


def test_plan_takes_global_batch_tokens_with_a_suffix(capsys):
    base = ["plan", "--cluster", EMU2, "--model", "tiny", "--seq-len", "16", "--no-baselines", "--json"]
    rc, by_tokens, _ = _cli(base + ["--global-batch-tokens", "0.125K"], capsys)
    assert rc == 0
    rc, by_seqs, _ = _cli(base + ["--global-batch", "8"], capsys)
    assert rc == 0
    assert json.loads(by_tokens)["plan"]["global_batch"] == 8 == json.loads(by_seqs)["plan"]["global_batch"]


@pytest.mark.parametrize("argv, dest, value", [
    (["profile", "--chip", "a,b", "--out", "p.json"], "chips", "a,b"),
    (["profile", "--chips", "a,b", "--out", "p.json"], "chips", "a,b"),
    (["align", "--chips", "cpu", "--batch", "4"], "global_batch", 4),
    (["align", "--chips", "cpu", "--global-batch", "4"], "global_batch", 4),
    (["demo", "--global-batch", "4"], "global_batch", 4),
])
def test_one_spelling_everywhere_with_the_old_ones_as_aliases(argv, dest, value):
    assert getattr(build_parser().parse_args(argv), dest) == value


def test_demo_help_states_the_true_defaults():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["demo"]
    checked = 0
    for action in sub._actions:
        numeric = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
        if numeric and action.help and "default" in action.help:
            assert f"(default {action.default})" in action.help % {"default": action.default}, action.help
            checked += 1
    assert checked >= 4  # --seq-len, --global-batch, --steps, --baseline-steps


def test_outputs_go_into_missing_directories(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "plan.json"
    rc, _, err = _cli(["plan", "--cluster", EMU2, "--model", "tiny", "--seq-len", "16", "--global-batch", "8",
                       "--no-baselines", "--out", out], capsys)
    assert rc == 0, err and out.is_file()
    trace, plot = tmp_path / "c" / "trace.json", tmp_path / "d" / "e" / "timeline.png"
    rc, _, err = _cli(["simulate", "--plan", out, "--trace", trace, "--plot", plot], capsys)
    assert rc == 0, err
    assert json.loads(trace.read_text())["traceEvents"] and plot.stat().st_size > 0


def test_show_json_is_the_validated_plan(capsys):
    rc, out, _ = _cli(["show", "--json", DEMO_PLAN], capsys)
    assert rc == 0
    d = json.loads(out)
    assert d["plan"] == json.loads(Path(DEMO_PLAN).read_text()) | {"optimizer": d["plan"]["optimizer"]}
    assert (d["n_stages"], d["n_micro"], d["n_devices"], d["tokens_per_step"]) == (3, 4, 8, 16 * 64)


def test_tables_are_not_cut_when_output_is_not_a_terminal(tmp_path, capsys):
    """Piped output keeps every cell and every sentence whole (rich's default 80 columns cut both)."""
    rc, out, _ = _cli(["simulate", "--plan", DEMO_PLAN, "--all-schedules"], capsys)
    assert rc == 0
    assert "…" not in out
    assert any("simulated" in line and "cost model" in line for line in out.splitlines()), out
    rc, out, _ = _cli(["plan", "--cluster", EMU2, "--model", "tiny", "--seq-len", "16", "--global-batch", "8"], capsys)
    assert rc == 0 and "…" not in out


def test_counts_and_small_memories_read_right(tmp_path, capsys):
    one = json.loads(Path(DEMO_PLAN).read_text())
    one["stages"] = [{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [0, 8]}]
    path = tmp_path / "one.json"
    path.write_text(json.dumps(one))
    rc, out, _ = _cli(["simulate", "--plan", path], capsys)
    assert rc == 0 and "1 stage," in out and "1 stages" not in out
    # Emulated chips have MiB of memory: no "0.0 / 0" in the planner's table.
    rc, out, _ = _cli(["plan", "--cluster", EMU2, "--model", "tiny", "--seq-len", "16", "--global-batch", "8",
                       "--no-baselines"], capsys)
    assert rc == 0
    assert not re.search(r"\b0\.0 / 0\b", out), out
    assert re.search(r"\b0\.0\d+ / 0\.0\d+\b", out), out  # emu-mid: 64 MiB = 0.0625 GiB


# `h2jax demo --json` (idle chips, tokens per used chip): tests/test_cli_smoke.py, in the one demo run.
