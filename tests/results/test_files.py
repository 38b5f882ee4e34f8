"""results.files: writes are atomic (old file or new, no temp left, streams written in place,
devices refused), reads refuse bad input in one line naming the file and field."""

import json
import os
import stat
from pathlib import Path

import pytest

from swa_bench.results import (
    RESULTS_CSV,
    RESULTS_JSON,
    RUN_OUTPUT_FILES,
    ResultsError,
    atomic_writer,
    load_results,
    refuse_run_output,
    save_results,
    write_text_atomic,
)
from tests.report.synthetic import synthetic_run


def _no_temp_files(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.startswith(".")]


def test_round_trip_through_run_dir_and_file(tmp_path):
    results = synthetic_run()
    json_path, csv_path = save_results(tmp_path, results)
    assert json_path == tmp_path / RESULTS_JSON and csv_path == tmp_path / RESULTS_CSV
    assert load_results(tmp_path) == results
    assert load_results(json_path) == results
    assert _no_temp_files(tmp_path)


def test_a_version_2_file_reads_and_a_new_run_records_the_tool(tmp_path):
    """Version 3 added the tool's version and whether an advice was decided: a version-2 file
    reads them as not recorded and decided; a run started now records the version."""
    from swa_bench import tool_version
    from swa_bench.run.commands import new_results
    from swa_bench.scenario import default_scenario_path, load_scenario

    data = json.loads(synthetic_run().model_dump_json())
    data["schema_version"] = 2
    del data["swa_bench_version"]
    for advice in data["threshold_advice"]:
        del advice["decided"]
    (tmp_path / RESULTS_JSON).write_text(json.dumps(data))
    old = load_results(tmp_path)
    assert old.schema_version == 2 and old.swa_bench_version is None
    assert all(a.decided for a in old.threshold_advice)
    path = default_scenario_path()
    fresh = new_results(path, load_scenario(path), environment={})
    assert fresh.schema_version == 4 and fresh.swa_bench_version == tool_version()


ROOFLINE_FIELDS = ("reference_bytes", "replay_bytes", "roofline_ms", "roofline_ideal_speedup",
                   "roofline_efficiency")


def test_the_roofline_figures_round_trip_and_older_files_read_them_as_not_recorded(tmp_path):
    results = synthetic_run()
    save_results(tmp_path, results)
    saved = json.loads((tmp_path / RESULTS_JSON).read_text())
    case = saved["cases"][0]
    assert case["roofline_ideal_speedup"] == results.cases[0].roofline_ideal_speedup
    assert case["reference_bytes"] == results.cases[0].reference_bytes > 0
    assert load_results(tmp_path).cases[0].roofline_ms == results.cases[0].roofline_ms
    for case in saved["cases"]:
        for name in ROOFLINE_FIELDS:
            del case[name]
    (tmp_path / RESULTS_JSON).write_text(json.dumps(saved))
    old = load_results(tmp_path)
    assert all(c.roofline_ideal_speedup is None and c.roofline_efficiency is None
               and c.reference_bytes is None and c.roofline_ms == {} for c in old.cases)


def test_the_task_chunk_size_round_trips_and_older_files_read_whole_prompts(tmp_path):
    """checks.tasks.chunk_size is recorded in each case's task results; a file written before
    the setting (no key) reads as whole prompts, which is what its runs prefilled."""
    from swa_bench.results import HeldOutLoss, TaskCell, TaskResults

    results = synthetic_run()
    cell = TaskCell(task="recall", prompt_len=64, distance=8, prompts=2, accuracy=0.5,
                    answer_loss=1.0, agreement=1.0)
    held = HeldOutLoss(prompt_len=64, prompts=2, continuation=16, loss=1.5, prefill_loss=1.4)
    for case, chunk in zip(results.cases[:2], (None, 64), strict=True):
        case.tasks = TaskResults(policy=case.policy, model="seeded", chunk_size=chunk,
                                 cells=[cell], held_out=[held])
    save_results(tmp_path, results)
    saved = json.loads((tmp_path / RESULTS_JSON).read_text())
    assert [c["tasks"]["chunk_size"] for c in saved["cases"][:2]] == [None, 64]
    assert [c.tasks.chunk_size for c in load_results(tmp_path).cases[:2]] == [None, 64]
    for case in saved["cases"][:2]:
        del case["tasks"]["chunk_size"]
    (tmp_path / RESULTS_JSON).write_text(json.dumps(saved))
    assert [c.tasks.chunk_size for c in load_results(tmp_path).cases[:2]] == [None, None]


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "report.md"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_writer(target) as handle:
        handle.write("half written")
        raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert _no_temp_files(tmp_path)


def test_save_replaces_an_earlier_run_in_place(tmp_path):
    save_results(tmp_path, synthetic_run(error=False))
    save_results(tmp_path, synthetic_run())
    assert len(load_results(tmp_path).cases) == len(synthetic_run().cases)
    assert sorted(p.name for p in tmp_path.iterdir()) == [RESULTS_CSV, RESULTS_JSON]


def _broken(tmp_path: Path, mutate) -> Path:
    data = json.loads(synthetic_run().model_dump_json())
    mutate(data)
    path = tmp_path / RESULTS_JSON
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("mutate", "field", "words"), [
    (lambda d: d["cases"][1].update(status="bogus"), "cases.1.status", "'ok'"),
    (lambda d: d["cases"][0].update(surprise=1), "cases.0.surprise", "Extra inputs"),
    (lambda d: d.pop("scenario_hash"), "scenario_hash", "Field required"),
    (lambda d: d["cases"][0]["checks"][0].update(passed="maybe"), "cases.0.checks.0.passed",
     "boolean"),
    (lambda d: d.update(schema_version=5), "schema_version", "unsupported version 5"),
    (lambda d: d.update(schema_version=True), "schema_version", "unsupported version True"),
])
def test_invalid_content_names_the_field(tmp_path, mutate, field, words):
    path = _broken(tmp_path, mutate)
    with pytest.raises(ResultsError) as info:
        load_results(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{path}: {field}: ")
    assert words in message and "\n" not in message


@pytest.mark.parametrize(("text", "words"), [
    ("", "empty file"),
    ('{"scenario_name": "x",', "invalid JSON"),
    ("[1, 2]", "top level must be an object"),
])
def test_unparseable_files(tmp_path, text, words):
    path = tmp_path / RESULTS_JSON
    path.write_text(text)
    with pytest.raises(ResultsError) as info:
        load_results(path)
    assert str(info.value).startswith(f"{path}: ") and words in str(info.value)
    assert "\n" not in str(info.value)


def test_a_pipe_is_refused_unread(tmp_path):
    """A FIFO reports size 0 and blocks the reader until a writer comes: refused before."""
    fifo = tmp_path / "results.json"
    os.mkfifo(fifo)
    for given in (fifo, tmp_path):
        with pytest.raises(ResultsError, match="is not a regular file"):
            load_results(given)


def test_missing_file_and_empty_run_dir(tmp_path):
    with pytest.raises(ResultsError, match="no such file"):
        load_results(tmp_path / "nope.json")
    with pytest.raises(ResultsError) as info:
        load_results(tmp_path)
    assert str(info.value).startswith(str(tmp_path / RESULTS_JSON))


def test_a_run_folders_output_is_refused_and_nothing_else(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_results(run_dir, synthetic_run())
    for name in RUN_OUTPUT_FILES:
        link = tmp_path / f"link-to-{name}"
        link.symlink_to(run_dir / name)
        for out in (run_dir / name, link):
            with pytest.raises(ResultsError) as info:
                refuse_run_output(out, "--out")
            assert str(info.value) == (f"{out}: --out: is the {name} of the run folder {run_dir}: "
                                       "refusing to replace a run's output (write it elsewhere)")
    refuse_run_output(run_dir / "compare.md", "--out", own="compare.md")
    refuse_run_output(run_dir / "benchmark.json", "--out")
    refuse_run_output(tmp_path / "report.md", "--out")


def test_a_fifo_is_written_in_place(tmp_path):
    """Renaming a temp file over a named pipe replaced it with a regular file nobody reads."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_text_atomic(fifo, "through the pipe")
        assert os.read(reader, 1024) == b"through the pipe"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and _no_temp_files(tmp_path)


def test_a_character_device_stays_one(tmp_path):
    """A node like /dev/null (made here, so the machine's own is never at stake)."""
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs root")
    write_text_atomic(null, "discarded")
    assert stat.S_ISCHR(os.stat(null).st_mode) and _no_temp_files(tmp_path)


def test_a_symlink_keeps_pointing_at_the_file_it_names(tmp_path):
    target = tmp_path / "target.md"
    target.write_text("old")
    link = tmp_path / "link.md"
    link.symlink_to(target)
    write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_a_block_device_is_refused(tmp_path):
    """Neither replaced nor written: writing a disk's node overwrites the disk. The numbers name
    no device (240 is for local use), so nothing real is at stake."""
    disk = tmp_path / "disk"
    try:
        os.mknod(disk, stat.S_IFBLK | 0o600, os.makedev(240, 250))
    except PermissionError:
        pytest.skip("mknod needs root")
    with pytest.raises(OSError, match="block device"):
        write_text_atomic(disk, "not on a disk")
    assert stat.S_ISBLK(os.stat(disk).st_mode) and _no_temp_files(tmp_path)


def test_the_mfu_basis_round_trips_and_older_files_read_it_as_not_recorded(tmp_path):
    from swa_bench.results import MfuBasis

    results = synthetic_run()
    results.cases[0].mfu_basis = MfuBasis(
        dtype="bfloat16", dtype_tflops=794.5, fp8_tflops=1480.25,
        fp8_flops={"reference": 3 * 10**12, "replay": 10**12},
        dtype_flops={"reference": 5 * 10**12, "replay": 2 * 10**12},
        fp8_gemm_flops={"reference": 3 * 10**12, "replay": 10**12}, note="both peaks")
    results.environment["gemm_tflops"] = {"bfloat16": 794.5, "fp8": 1480.25}
    save_results(tmp_path, results)
    back = load_results(tmp_path)
    assert back.cases[0].mfu_basis == results.cases[0].mfu_basis
    assert back.environment["gemm_tflops"]["fp8"] == 1480.25
    saved = json.loads((tmp_path / RESULTS_JSON).read_text())
    for case in saved["cases"]:
        del case["mfu_basis"]
    saved["environment"]["gemm_tflops"] = {"bfloat16": 794.5}
    (tmp_path / RESULTS_JSON).write_text(json.dumps(saved))
    assert all(c.mfu_basis is None for c in load_results(tmp_path).cases)
