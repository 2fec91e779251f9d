"""benchmarks/fingerprint.py: the digests a refactor compares, on a hand-made run directory."""

import csv
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def fingerprint_module():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import fingerprint
    finally:
        sys.path.remove(str(BENCHMARKS))
    return fingerprint


def write_run(run: Path, loss: str, elapsed: str, weights: bytes) -> None:
    (run / "eval").mkdir(parents=True, exist_ok=True)
    (run / "final").mkdir(exist_ok=True)
    with (run / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "train/loss", "time/elapsed", "memory/peak_gb"])
        writer.writeheader()
        writer.writerow({"step": "1", "train/loss": loss, "time/elapsed": elapsed, "memory/peak_gb": elapsed})
    (run / "generations.jsonl").write_text('{"step": 1, "completion": "<answer>7</answer>"}\n')
    (run / "eval" / "iter_00000.jsonl").write_text('{"correct": true}\n')
    (run / "final" / "model.safetensors").write_bytes(weights)


def test_digests_ignore_timings_and_catch_any_other_change(tmp_path):
    fingerprint = fingerprint_module()
    write_run(tmp_path / "a", loss="0.25", elapsed="1.5", weights=b"\x00\x01")
    write_run(tmp_path / "b", loss="0.25", elapsed="9.75", weights=b"\x00\x01")  # only the timings differ
    write_run(tmp_path / "c", loss="0.25", elapsed="1.5", weights=b"\x00\x02")  # one weight byte differs
    write_run(tmp_path / "d", loss="0.26", elapsed="1.5", weights=b"\x00\x01")  # one metric differs
    a, b, c, d = (fingerprint.digests(tmp_path / name) for name in "abcd")
    assert sorted(a) == [
        "eval/iter_00000.jsonl",
        "final/model.safetensors",
        "generations.jsonl",
        "metrics.csv (timings aside)",
    ]
    assert a == b
    assert [name for name in a if a[name] != c[name]] == ["final/model.safetensors"]
    assert [name for name in a if a[name] != d[name]] == ["metrics.csv (timings aside)"]
