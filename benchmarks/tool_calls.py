"""How often a model calls the calculator of calc_arith before any RL: greedy and sampled tool-call rates.

    .venv/bin/python benchmarks/tool_calls.py --model smollm2-135m-instruct --samples 4
    .venv/bin/python benchmarks/tool_calls.py --model tiny-tools --no-system-prompt
    .venv/bin/python benchmarks/tool_calls.py --model qwen2.5-coder-0.5b-instruct --call-format json \
        --mul-range 100 999 [--max-turns 1]      # JSON calls, the tool in the template's tools= block (1: no tool)

Episodes run through the trainer's own loop (`llm_pg.engines.episodes.run_episodes`, HF engine) on calc_arith's
eval set; prints, per decoding, the share of episodes with a call, exact match, mean turns, and a few transcripts.
A model that never calls the tool gives RL nothing to reinforce: measure this first.
"""

from __future__ import annotations

import argparse
import time

import torch

from llm_pg.data.tasks import CalcArithTask
from llm_pg.data.tasks.calc_arith import calc
from llm_pg.engines.episodes import KINDS, run_episodes
from llm_pg.engines.hf import HFEngine
from llm_pg.models.generation import Sampling, eos_token_ids
from llm_pg.models.loading import load_tokenizer, resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="sampled episodes per prompt (T below)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-system-prompt", action="store_true", help="no system turn (the tiny model has none)")
    parser.add_argument("--system-prompt", default=None, help="another system turn than calc_arith's default")
    parser.add_argument("--prompt-template", default="{expr}=?", help="the user turn ({expr}: the product)")
    parser.add_argument("--show", type=int, default=3, help="transcripts printed per decoding")
    parser.add_argument("--call-format", choices=["tags", "json"], default="tags")
    parser.add_argument("--mul-range", type=int, nargs=2, default=[10, 99], help="both operands' inclusive range")
    parser.add_argument("--max-turns", type=int, default=3, help="1: the task without the tool")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--result-template",
        default="{value}",
        help="the calculator's observation ({value}: its result, {expression}: the call's input; json calls only)",
    )
    parser.add_argument("--shots", type=int, default=0, help="worked products before the question (calc_arith)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    prompt = {"system_prompt": None} if args.no_system_prompt else {}
    if args.system_prompt is not None:
        prompt = {"system_prompt": args.system_prompt}
    task = CalcArithTask(
        mul_range=tuple(args.mul_range),
        max_turns=args.max_turns,
        eval_size=args.eval_size,
        prompt_template=args.prompt_template,
        call_format=args.call_format,
        shots=args.shots,
        **prompt,
    )
    if args.call_format == "json" and args.result_template != "{value}":
        task.tools = {"calculator": worded(args.result_template)}
    engine, eos = HFEngine(model, tokenizer), eos_token_ids(model, tokenizer)
    examples = task.eval_examples
    for name, sampling, count in (
        ("greedy", Sampling(max_new_tokens=args.max_new_tokens, greedy=True), 1),
        (
            f"T={args.temperature}",
            Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature),
            args.samples,
        ),
    ):
        start = time.perf_counter()
        out = run_episodes(engine, tokenizer, task, examples, sampling, num_samples=count, seed=0, eos=eos)
        rows = [examples[i // count] for i in range(len(out.texts))]
        correct = [task.score(t, e).correct for t, e in zip(out.texts, rows, strict=True)]
        rate = (out.tool_calls > 0).float().mean()
        print(
            f"{args.model} {name}: {len(out.texts)} episodes, tool-call rate {rate:.3f}, "
            f"exact match {sum(correct) / len(correct):.3f}, turns {out.turns.float().mean():.2f}, "
            f"tool errors {out.tool_errors.sum().item()}, truncated {out.truncated.float().mean():.3f} "
            f"({time.perf_counter() - start:.0f} s)"
        )
        if out.tool_error_kinds is not None:
            kinds = {
                str(kind): int(n) for kind, n in zip(KINDS, out.tool_error_kinds.sum(0).tolist(), strict=True) if n
            }
            print(
                f"    errors by kind: {kinds or 'none'}; "
                f"tokens per episode {out.completion_attention.sum(1).float().mean():.1f}"
            )
        for transcript in out.transcripts[: args.show]:
            print("   ", repr(transcript[:300]))


def worded(template: str):
    """The JSON calculator with its result put into `template` (the same schema: the same tool block)."""

    def calculator(expression: str) -> str:
        return template.replace("{value}", calc(expression)).replace("{expression}", expression)

    calculator.__doc__ = calc.__doc__
    return calculator


if __name__ == "__main__":
    main()
