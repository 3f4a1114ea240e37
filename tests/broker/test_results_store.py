"""The results store on disk: append-only JSON Lines by batch and hour, read by location or
found by job id, whole lines only, pruned by the hour."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from broker.resultstore import DirectoryResults, hour_of, results_store
from core.settings import Settings

NOW = time.time()


def line(job_id: str, size: int = 10) -> bytes:
    return json.dumps({"job_id": job_id, "ids": list(range(size))}).encode()


def test_a_line_reads_back_from_its_location(results: DirectoryResults) -> None:
    location = results.put("j1", "b1", line("j1"), NOW)
    assert results.read(location) == line("j1")
    assert (results.root / hour_of(NOW) / "b1.jsonl").read_bytes() == line("j1") + b"\n"


def test_jobs_outside_batches_share_a_file_and_batches_have_their_own(
    results: DirectoryResults,
) -> None:
    results.put("j1", None, line("j1"), NOW)
    results.put("j2", "b1", line("j2"), NOW)
    results.put("j3", None, line("j3"), NOW)
    part = results.root / hour_of(NOW)
    assert sorted(p.name for p in part.glob("*.jsonl")) == ["b1.jsonl", "rollouts.jsonl"]
    assert (part / "rollouts.jsonl").read_bytes().splitlines() == [line("j1"), line("j3")]


def test_concurrent_writers_never_interleave_their_lines(results: DirectoryResults) -> None:
    locations: dict[str, str] = {}

    def write(worker: int) -> None:
        for i in range(40):
            job_id = f"w{worker}-{i}"
            locations[job_id] = results.put(job_id, "b1", line(job_id, 500), NOW)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results.read(loc) == line(job, 500) for job, loc in locations.items())
    lines = (results.root / hour_of(NOW) / "b1.jsonl").read_bytes().splitlines()
    assert sorted(lines) == sorted(line(job, 500) for job in locations)


def test_a_half_written_line_is_ignored_and_the_next_starts_on_its_own(
    results: DirectoryResults,
) -> None:
    first = results.put("j1", "b1", line("j1"), NOW)
    path = results.root / hour_of(NOW) / "b1.jsonl"
    torn_at = path.stat().st_size
    with path.open("ab") as f:  # a writer that died mid-line
        f.write(line("j2")[:7])
    torn = f"{hour_of(NOW)}/b1.jsonl:{torn_at}:{len(line('j2')) + 1}"
    assert results.read(torn) is None
    after = results.put("j3", "b1", line("j3"), NOW)
    assert results.read(first) == line("j1")
    assert results.read(after) == line("j3")
    assert path.read_bytes().splitlines() == [line("j1"), line("j2")[:7], line("j3")]


def test_a_location_outside_the_store_reads_nothing(results: DirectoryResults) -> None:
    results.put("j1", "b1", line("j1"), NOW)
    assert results.read("../../etc/passwd:0:10") is None
    assert results.read(f"{hour_of(NOW)}/../x.jsonl:0:10") is None
    assert results.read("not a location") is None


def test_a_job_is_found_by_id_alone_latest_line_first(results: DirectoryResults) -> None:
    results.put("j1", "b1", line("j1", 1), NOW - 7200)
    results.put("j10", "b1", line("j10"), NOW)
    results.put("j1", "b2", line("j1", 2), NOW)
    assert results.find("j1") == line("j1", 2)
    assert results.find("j10") == line("j10")
    assert results.find("j") is None


def test_hours_past_the_window_are_pruned(tmp_path: Path) -> None:
    results = DirectoryResults(tmp_path, keep=int(3.5 * 3600))
    old = results.put("old", "b1", line("old"), NOW - 5 * 3600)
    new = results.put("new", "b1", line("new"), NOW - 2 * 3600)
    assert results.prune(NOW) == [hour_of(NOW - 5 * 3600)]
    assert results.read(old) is None
    assert results.find("old") is None
    assert results.read(new) == line("new")


def test_writing_prunes_the_expired_hours(tmp_path: Path) -> None:
    results = DirectoryResults(tmp_path, keep=3600)
    results.put("old", "b1", line("old"), NOW - 3 * 3600)
    DirectoryResults(tmp_path, keep=3600).put("new", "b1", line("new"), NOW)
    assert results.hours() == [hour_of(NOW)]


def test_the_settings_put_results_under_the_data_directory(tmp_path: Path) -> None:
    store = results_store(Settings(data_dir=tmp_path))
    assert isinstance(store, DirectoryResults)
    assert store.root == tmp_path / "results"
    mine = results_store(Settings(data_dir=tmp_path, results_dir=tmp_path / "r", results_keep=7200))
    assert isinstance(mine, DirectoryResults)
    assert (mine.root, mine.keep) == (tmp_path / "r", 7200)


def test_a_lookup_by_id_reads_only_the_ids_shard_of_each_hour(results: DirectoryResults) -> None:
    ids = ["ab" + "0" * 30, "ab" + "1" * 30, "cd" + "0" * 30]
    for job_id in ids:
        results.put(job_id, "b1", line(job_id), NOW)
    index = results.root / hour_of(NOW) / "index"
    assert sorted(p.name for p in index.iterdir()) == ["ab.tsv", "cd.tsv"]
    assert len((index / "ab.tsv").read_bytes().splitlines()) == 2
    for job_id in ids:
        assert results.find(job_id) == line(job_id)
    assert results.find("ef" + "0" * 30) is None
    assert results.find("ab" + "2" * 30) is None
