"""Run folders: nothing lost, nothing silently replaced, refused before any case runs."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock
from typer.testing import CliRunner

from swa_bench.cli import app
from swa_bench.results import save_results
from swa_bench.run.folder import (
    LOCK_FILE,
    RunFolderError,
    check_target,
    claim,
    existing_run_problem,
    plan_run_dirs,
    resume_command,
)
from tests.report import synthetic

REPO = Path(__file__).resolve().parents[2]
TINY = """\
name: {name}
device: cpu
model: {{preset: tiny}}
workload: {{requests: [{{prompt_len: 12}}, {{prompt_len: 9, decode: true}}]}}
sweep: {{grid: {{workload.requests.0.prompt_len: [10, 12, 14]}}}}
checks: {{e2: {{enabled: false}}, e3: {{enabled: false}}, e4: {{enabled: false}},
          e5: {{enabled: false}}}}
timing: {{enabled: false}}
"""

try:
    runner = CliRunner(mix_stderr=False)
except TypeError:
    runner = CliRunner()


def scenario(tmp_path: Path, name: str = "tiny", file: str | None = None) -> Path:
    path = tmp_path / (file or f"{name}.yaml")
    path.write_text(TINY.format(name=name))
    return path


def earlier_run(folder: Path, name: str) -> bytes:
    folder.mkdir(parents=True, exist_ok=True)
    save_results(folder, synthetic.synthetic_run(scenario_name=name))
    return (folder / "results.json").read_bytes()


def one_line_exit_2(result, *parts: str) -> None:
    assert result.exit_code == 2, result.output
    assert len(result.stderr.splitlines()) == 1, result.stderr
    for part in parts:
        assert part in result.stderr, result.stderr


# --- pure rules -------------------------------------------------------------------------------


def test_plan_names_one_folder_per_scenario(tmp_path):
    out = tmp_path / "out"
    assert plan_run_dirs(["a"], ["a.yaml"], out, resume=False, stamp="S") == [out]
    assert plan_run_dirs(["a", "b"], ["a.yaml", "b.yaml"], out, resume=False, stamp="S") == [
        out / "a", out / "b"]
    assert plan_run_dirs(["a"], ["a.yaml"], None, resume=False, stamp="S",
                         root=tmp_path) == [tmp_path / "a-S"]


def test_two_scenarios_with_one_name_are_refused(tmp_path):
    with pytest.raises(RunFolderError, match="like a.yaml"):
        plan_run_dirs(["x", "x"], ["a.yaml", "b.yaml"], tmp_path, resume=False, stamp="S")
    with pytest.raises(RunFolderError):  # also without --out: one UTC second, one folder
        plan_run_dirs(["x", "x"], ["a.yaml", "b.yaml"], None, resume=False, stamp="S")


def test_resume_without_out_takes_the_newest_earlier_run(tmp_path):
    earlier_run(tmp_path / "a-1", "a")
    earlier_run(tmp_path / "a-2", "a")
    assert plan_run_dirs(["a"], ["a.yaml"], None, resume=True, stamp="9",
                         root=tmp_path) == [tmp_path / "a-2"]


def test_existing_runs_are_kept_unless_the_user_says_otherwise(tmp_path):
    earlier_run(tmp_path, "other")
    assert "holds a run of scenario 'other'" in existing_run_problem(
        tmp_path, "tiny", "sha", resume=True)
    problem = existing_run_problem(tmp_path, "other", "sha", resume=False)
    assert "--resume" in problem and "--overwrite" in problem
    assert "another version" in existing_run_problem(tmp_path, "other", "sha", resume=True)
    assert existing_run_problem(tmp_path / "new", "tiny", "sha", resume=False) is None


def test_check_target_rejects_files_and_dangling_links(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    for path, words in ((tmp_path / "f", "is a file"), (tmp_path / "f" / "run", "which is a file"),
                        (tmp_path / "link", "symlink to missing"),
                        (tmp_path / "link" / "run", "symlink to missing")):
        with pytest.raises(RunFolderError, match=words):
            check_target(path)
    check_target(tmp_path / "new" / "deeper")  # creates nothing
    assert not (tmp_path / "new").exists()


def test_claim_locks_cleans_temp_files_and_releases(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    stale = folder / ".results.json.abc123.tmp"  # what a SIGKILL mid-write leaves
    stale.write_text("{")
    with claim([folder], ["tiny"], ["sha"], resume=True, overwrite=False,
               resume_command="swa-bench run --resume"):
        assert not stale.exists()
        with pytest.raises(RunFolderError, match="another swa-bench run"):
            with claim([folder], ["tiny"], ["sha"], resume=True, overwrite=False,
                       resume_command=""):
                pass
    with claim([folder], ["tiny"], ["sha"], resume=True, overwrite=False, resume_command=""):
        pass  # released


def test_a_failed_claim_leaves_no_folder_behind(tmp_path):
    earlier_run(tmp_path / "out" / "b", "other")
    with pytest.raises(RunFolderError):
        with claim([tmp_path / "out" / "a", tmp_path / "out" / "b"], ["a", "b"], ["s", "s"],
                   resume=False, overwrite=False, resume_command=""):
            pass
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["b"]


def test_ctrl_c_inside_a_claim_says_what_was_kept(tmp_path):
    from swa_bench.run.folder import Interrupted

    folder = tmp_path / "run"
    command = resume_command(["s.yaml"], folder, [folder])
    assert command == f"swa-bench run s.yaml --out {folder} --resume"
    with pytest.raises(Interrupted) as caught:
        with claim([folder], ["s"], ["h"], resume=False, overwrite=False, resume_command=command):
            raise KeyboardInterrupt
    assert str(caught.value) == "interrupted before any case finished: nothing was kept"
    assert not folder.exists(), "the folder it made is gone, so no --resume is offered for it"
    with pytest.raises(Interrupted, match=r"^interrupted: kept 12 finished cases in .*run; "
                                          r"continue with: swa.*--resume$"):
        with claim([folder], ["s"], ["h"], resume=False, overwrite=False, resume_command=command):
            save_results(folder, synthetic.synthetic_run(error=False))
            raise KeyboardInterrupt


def test_a_read_only_folder_is_refused_before_work(tmp_path, monkeypatch):
    """Root writes into a chmod 555 folder, so there mkdir refuses as the kernel would."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:
        real_mkdir = Path.mkdir

        def read_only(self, *args, **kwargs):
            if folder in self.parents:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", read_only)
    try:
        result = runner.invoke(app, ["run", str(scenario(tmp_path)), "--out", str(folder / "x")])
        one_line_exit_2(result, "cannot write", "Permission denied")
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)


# --- through the CLI (refusals run no case) ---------------------------------------------------


def test_out_holding_another_scenarios_run_is_refused(tmp_path):
    out = tmp_path / "out"
    before = earlier_run(out, "someone-else")
    result = runner.invoke(app, ["run", str(scenario(tmp_path)), "--out", str(out)])
    one_line_exit_2(result, "holds a run of scenario 'someone-else'", "--overwrite")
    assert (out / "results.json").read_bytes() == before
    result = runner.invoke(app, ["run", str(scenario(tmp_path)), "--out", str(out), "--resume"])
    one_line_exit_2(result, "someone-else")
    assert (out / "results.json").read_bytes() == before


def test_two_same_name_scenarios_into_one_out_are_refused(tmp_path):
    a = scenario(tmp_path, "same", "a.yaml")
    b = scenario(tmp_path, "same", "b.yaml")
    result = runner.invoke(app, ["run", str(a), str(b), "--out", str(tmp_path / "out")])
    one_line_exit_2(result, "'same'")
    assert not (tmp_path / "out").exists()


def test_a_concurrent_run_is_refused_while_the_lock_is_held(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with FileLock(out / LOCK_FILE, timeout=0):
        result = runner.invoke(app, ["run", str(scenario(tmp_path)), "--out", str(out)])
    one_line_exit_2(result, "another swa-bench run is writing this folder")
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]


def test_resume_and_overwrite_together_are_refused(tmp_path):
    result = runner.invoke(app, ["run", str(scenario(tmp_path)), "--out", str(tmp_path / "o"),
                                 "--resume", "--overwrite"])
    one_line_exit_2(result, "--resume and --overwrite")


def test_overwrite_replaces_and_a_rerun_without_it_is_refused(tmp_path):
    out = tmp_path / "out"
    earlier_run(out, "someone-else")
    path = scenario(tmp_path)
    result = runner.invoke(app, ["run", str(path), "--out", str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert "tiny" in (out / "results.json").read_text()
    again = runner.invoke(app, ["run", str(path), "--out", str(out)])
    one_line_exit_2(again, "--resume")
    resumed = runner.invoke(app, ["run", str(path), "--out", str(out), "--resume"])
    assert resumed.exit_code == 0 and "3 case(s) done, 0 to run" in " ".join(
        resumed.output.split())


def test_a_full_disk_is_one_line_and_keeps_results(tmp_path, monkeypatch):
    import errno

    from swa_bench.run import commands as case_runner

    real_save, calls = case_runner.save_results, []

    def save(run_dir, results):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "results.json"))
        return real_save(run_dir, results)

    monkeypatch.setattr(case_runner, "save_results", save)
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(scenario(tmp_path)), "--out", str(out)])
    one_line_exit_2(result, "No space left on device")
    assert len(__import__("json").loads((out / "results.json").read_text())["cases"]) == 1


def test_ctrl_c_prints_what_was_kept_and_the_resume_command(tmp_path):
    path = scenario(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "swa_bench", "run", str(path), "--out",
                             str(out)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "results.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal")
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    (line,) = stderr.strip().splitlines()
    assert "finished case" in line and f"in {out}" in line
    assert line.endswith(f"swa-bench run {path} --out {out} --resume")
    assert not list(out.glob(".*.tmp"))


# --- a refusal changes nothing: every input judged before a folder is claimed or cleared ------


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def shard_file(folder: Path, name: str = "tiny", digest: str | None = None) -> Path:
    """A shard file that a worker of a killed ``--gpus`` sweep of scenario ``name`` left."""
    from swa_bench.bench.environment import scenario_hash

    case = synthetic.synthetic_run(scenario_name=name).cases[0].model_dump(mode="json")
    path = folder / ".shards" / "shard-0.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"scenario_name": name, "cases": [case],
                                "scenario_hash": digest or scenario_hash(TINY.format(name=name))}))
    return path


@pytest.mark.parametrize("bad", ["select", "no_gpu"])
def test_overwrite_deletes_nothing_when_an_input_is_refused(tmp_path, monkeypatch, bad):
    out = tmp_path / "out"
    earlier_run(out, "tiny")
    before = snapshot(out)
    path = scenario(tmp_path)
    args = ["run", str(path), "--out", str(out), "--overwrite"]
    if bad == "select":
        args += ["-k", "nomatch"]
    else:
        path.write_text(path.read_text().replace("device: cpu", "device: cuda"))
        monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    result = runner.invoke(app, args)
    one_line_exit_2(result, str(path), "--select" if bad == "select" else "no GPU")
    assert snapshot(out) == before


def test_select_is_checked_in_every_scenario_before_any_runs(tmp_path):
    a = scenario(tmp_path, "a")
    b = scenario(tmp_path, "b")
    b.write_text(b.read_text().replace("[10, 12, 14]", "[20, 22, 24]"))
    result = runner.invoke(app, ["run", str(a), str(b), "--out", str(tmp_path / "out"),
                                 "-k", "T=11"])
    one_line_exit_2(result, f"{b}: --select: no case label or id contains 'T=11'")
    assert not (tmp_path / "out").exists()


def test_a_folder_holding_an_unfinished_sharded_run_is_refused(tmp_path):
    out = tmp_path / "out"
    shard_file(out)
    before = snapshot(out)
    result = runner.invoke(app, ["run", str(scenario(tmp_path)), "--out", str(out)])
    one_line_exit_2(result, f"{out}: ", "unfinished --gpus run", "--resume", "--overwrite")
    assert snapshot(out) == before


def test_a_refused_run_leaves_no_lock_file_behind(tmp_path):
    out = tmp_path / "out"
    earlier_run(out, "tiny")
    before = snapshot(out)
    for flags in ([], ["--resume"]):  # a run of 'tiny'; then of another version of it
        result = runner.invoke(app, ["run", str(scenario(tmp_path)), "--out", str(out), *flags])
        one_line_exit_2(result, f"{out}: ")
        assert snapshot(out) == before


@pytest.mark.parametrize("who", ["another scenario", "another version"])
def test_resume_refuses_shard_files_of_another_run(tmp_path, who):
    out = tmp_path / "out"
    shard = shard_file(out, "other") if who == "another scenario" else shard_file(
        out, "tiny", digest="sha256:0")
    before = snapshot(out)
    result = runner.invoke(app, ["run", str(scenario(tmp_path)), "--out", str(out), "--resume"])
    one_line_exit_2(result, f"{shard}: ", "'other'" if who == "another scenario" else
                    "another version of 'tiny'")
    assert snapshot(out) == before


@pytest.mark.parametrize(("content", "words"), [
    ("{not json", "invalid JSON"),
    ("", "invalid JSON"),
    ("[]", "must be an object, not list"),
    ('{"cases": []}', "scenario_name: Field required"),
    ('{"scenario_name": "tiny", "scenario_hash": "h", "cases": [{"case_id": 1}]}', "cases.0"),
])
def test_resume_refuses_a_corrupt_shard_file_in_one_line(tmp_path, content, words):
    out = tmp_path / "out"
    shard = shard_file(out)
    shard.write_text(content)
    before = snapshot(out)
    result = runner.invoke(app, ["run", str(scenario(tmp_path)), "--out", str(out), "--resume"])
    one_line_exit_2(result, f"{shard}: ", words)
    assert snapshot(out) == before


def test_dry_run_refuses_resume_with_overwrite_like_a_run(tmp_path):
    result = runner.invoke(app, ["run", str(scenario(tmp_path)), "--dry-run", "--resume",
                                 "--overwrite"])
    one_line_exit_2(result, "--resume and --overwrite")
