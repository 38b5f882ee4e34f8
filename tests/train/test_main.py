"""``python -m swa_bench.train`` on bad arguments: one line on stderr, exit 2, nothing written."""

from __future__ import annotations

import pytest

from swa_bench.train.__main__ import main


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--max-facts", "0"], "--max-facts must be at least 1"),
    (["--batch", "-2"], "--batch must be at least 1"),
    (["--seq-len", "8"], "seq_len 8 must lie in [64, 320]"),
    (["--steps", "many"], "argument --steps: invalid int value"),
    (["--length-warmup", "64-100"], "is not LENGTH:STEPS"),
    (["--length-warmup", "128:10,64:10"], "lengths rising"),
    (["--steps", "100", "--length-warmup", "64:100"], "leave none of 100"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, message, tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--device", "cpu", "--out", str(out)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("python -m swa_bench.train: ")
    assert not any(tmp_path.iterdir())
