"""The external probe's own arithmetic (the benchmarks' figures are computed from it)."""

from benchmarks.workload import turnaround
from tests.probe import Probe

MS = 1_000_000


def _probe(tmp_path, marks):
    path = tmp_path / "probe.log"
    path.write_text("".join(f"{kind} {key} {ns} {pid}\n" for kind, key, ns, pid in marks))
    return Probe(str(path))


def test_turnarounds_are_the_gaps_from_an_end_to_the_same_processs_next_start(tmp_path):
    probe = _probe(tmp_path, [
        ("start", "g:1", 0, 10), ("end", "g:1", 20 * MS, 10),
        ("start", "g:2", 1 * MS, 11), ("end", "g:2", 21 * MS, 11),
        ("start", "g:3", 23 * MS, 10),  # 3 ms after process 10's end
        ("start", "u:1", 30 * MS, 11),  # 9 ms after process 11's end
        ("end", "g:3", 43 * MS, 10),    # the last body of process 10: no gap after it
        ("end", "u:1", 50 * MS, 11),
    ])
    assert sorted(probe.turnarounds()) == [3.0, 9.0]
    assert probe.turnarounds("u:") == []  # u:1's end is followed by nothing
    assert sorted(probe.turnarounds("g:")) == [3.0, 9.0]
    assert probe.turnarounds("g:", since_ns=21 * MS) == [9.0]


def test_the_turnaround_summary_gives_mean_median_and_p99(tmp_path):
    marks = []
    for i, gap in enumerate([1, 2, 3, 10]):  # one process, gaps of 1, 2, 3 and 10 ms
        start = i * 100 * MS
        marks += [("start", f"k:{i}", start, 7), ("end", f"k:{i}", start + 20 * MS, 7),
                  ("start", f"k:{i}b", start + 20 * MS + gap * MS, 7),
                  ("end", f"k:{i}b", start + 50 * MS, 7)]
    probe = _probe(tmp_path, marks)
    figures = turnaround(probe, "k:", 0)
    # (k:{i}b's ends are followed by the next k:{i+1} start, 50 ms later, except the last)
    gaps = sorted([1.0, 2.0, 3.0, 10.0, 50.0, 50.0, 50.0])
    assert figures == {"turnaround_mean_ms": round(sum(gaps) / len(gaps), 2),
                       "turnaround_p50_ms": 10.0, "turnaround_p99_ms": 50.0}
    assert turnaround(probe, "none:", 0) == {}
