"""What a frozen LM head costs on the positions `logits_to_keep` slices, with and without a contiguous input.

    .venv/bin/python benchmarks/head_input.py                                   # Qwen2.5-Coder-0.5B (make qwen-model)
    .venv/bin/python benchmarks/head_input.py --model smollm2-135m-instruct --rows 32

transformers computes the logits of the last k positions as `lm_head(hidden[:, -k:, :])`. On that view (rows a
whole sequence apart) torch's matmul folds the rows into one matrix product only when the head's weight requires
grad; a frozen head (LoRA's, the reference model's) gets its `[V, H]` weight broadcast to every row and copied. The
models `llm_pg.models.loading` loads give the head a contiguous input (`contiguous_head_input`). Per row count, this
prints the median time and the peak RSS growth of one head call on a prefill's last position: the raw view (what
the head would get without the hook) against the hooked head. Interleaved repetitions; run with nothing else on the
machine.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from llm_pg.models.loading import LoRA, load_policy


def rss_gb() -> float:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1e6


class PeakRSS:
    """The process's peak RSS growth over a `with` block, sampled every 5 ms."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss_gb()
        self.running = True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_gb())
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.growth = self.peak - self.base


def main() -> None:
    def raw_head(hidden: torch.Tensor) -> torch.Tensor:  # the head's product without its hook
        return torch.nn.functional.linear(hidden, head.weight)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--positions", type=int, default=400, help="prompt length of the prefill")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = load_policy(args.model, torch.bfloat16, LoRA(r=8, target_modules=["q_proj"]))
    head = model.get_output_embeddings()
    width = head.weight.shape[1]
    print(f"{args.model}: head {tuple(head.weight.shape)} {head.weight.dtype}, frozen: {not head.weight.requires_grad}")
    for rows in args.rows:
        hidden = torch.randn(rows, args.positions, width, dtype=head.weight.dtype)
        kept = hidden[:, -1:, :]  # what logits_to_keep=1 gives the head
        times, peaks = {"raw view": [], "hooked head": []}, {"raw view": [], "hooked head": []}
        with torch.no_grad():
            for _ in range(args.repeats):
                for name, call in (("raw view", raw_head), ("hooked head", head)):
                    with PeakRSS() as peak:
                        start = time.perf_counter()
                        call(kept)
                        times[name].append(time.perf_counter() - start)
                    peaks[name].append(peak.growth)
        for name in times:
            spread = f"{min(times[name]) * 1e3:.0f}-{max(times[name]) * 1e3:.0f}"
            print(
                f"  {rows:3d} rows, {name:11s}: {statistics.median(times[name]) * 1e3:8.0f} ms (range {spread}), "
                f"peak RSS +{statistics.median(peaks[name]):.2f} GB"
            )


if __name__ == "__main__":
    main()
