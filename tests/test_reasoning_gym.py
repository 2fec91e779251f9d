"""ReasoningGymTask: reasoning-gym's answer extraction in linear time, its own scorer, seeds from the run, offline."""

import time

import pytest
from reasoning_gym.utils import extract_answer

from llm_pg.data.tasks import Example, ReasoningGymTask
from llm_pg.data.tasks.reasoning_gym import last_answer_tag

SMALL_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


@pytest.mark.parametrize(
    "text",
    [
        "<answer>12</answer>",
        "<answer> 12 </answer>",
        "<answer>\n12\n</answer>",
        "first <answer>1</answer> then <answer>2</answer>",  # the last tag
        "<answer>1</answer> <answer>2",  # an unclosed last tag: the closed one before it
        "<answer><answer>3</answer></answer>",
        "<answer></answer>",
        "<ANSWER>4</ANSWER>",  # case-sensitive, as the library
        "</answer><answer>5</answer>",
        "no tag",
        "<answer>  multi\nline  </answer>",
    ],
)
def test_last_answer_tag_is_the_librarys_extract_answer(text):
    assert last_answer_tag(text) == extract_answer(text)


def test_last_answer_tag_is_linear_on_hostile_text():
    for text in ("<answer>" * 100_000, "<answer>" * 50_000 + "</answer>" * 50_000, "9" * 1_000_000):
        start = time.perf_counter()
        last_answer_tag(text)
        assert time.perf_counter() - start < 1.0


def task(**kwargs) -> ReasoningGymTask:
    kwargs.setdefault("dataset_config", SMALL_ARITHMETIC)
    return ReasoningGymTask(dataset="basic_arithmetic", system_prompt=None, eval_size=8, **kwargs)


def test_items_come_from_the_run_seed_and_the_eval_set_is_deterministic():
    first, again, other = task(), task(), task()
    first.bind_seed(3)
    again.bind_seed(3)
    other.bind_seed(4)
    assert first.eval_examples == again.eval_examples and len(first.eval_examples) == 8
    assert first.eval_examples != other.eval_examples
    assert [first.train_example(i, 3) for i in range(5)] == [again.train_example(i, 3) for i in range(5)]
    assert [first.train_example(i, 3) for i in range(5)] != [first.train_example(i, 4) for i in range(5)]
    fixed = task(eval_seed=11)
    fixed.bind_seed(5)
    assert fixed.eval_examples == task(eval_seed=11).eval_examples  # eval_seed: the same set for any run seed
    example = first.eval_examples[0]
    assert (
        example.prompt.startswith("Calculate ") and example.fields["metadata"]["source_dataset"] == "basic_arithmetic"
    )


def test_its_own_scorer_decides_the_reward():
    t = task()
    t.bind_seed(0)
    example = t.eval_examples[0]
    gold = example.answer
    assert t.score(f"<think>hm</think><answer>{gold}</answer>", example).correct
    assert t.score(f"<answer>{gold}</answer>", example).components == {"score": 1.0}
    wrong = t.score("<answer>not a number</answer>", example)
    assert wrong.total == 0.0 and not wrong.correct
    assert t.score(gold, example).total == 0.0  # no answer tag: nothing to score
    # basic_arithmetic's score_answer (the library's default) gives len(gold) / len(answer) when the answer
    # contains the gold: partial credit, not correct
    partial = t.score(f"<answer>{gold} or so</answer>", example)
    assert partial.total == pytest.approx(len(gold) / len(f"{gold} or so")) and not partial.correct
    huge = t.score("<answer>" + gold + " " * 20_000 + "x</answer>", example)
    assert huge.total == 0.0  # over max_answer_chars: not scored


def test_a_scorer_that_raises_scores_zero(monkeypatch):
    t = task()
    dataset = t._train_dataset(0)

    def refuse(answer, entry):
        raise ValueError("cannot parse")

    monkeypatch.setattr(dataset, "score_answer", refuse)
    assert t.score("<answer>1</answer>", Example("p", "1", {"question": "q", "metadata": {}})).total == 0.0


def test_system_prompts_by_name_and_one_line_errors():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    assert ReasoningGymTask(system_prompt="direct").system_prompt == SYSTEM_PROMPTS["direct"]
    assert ReasoningGymTask(system_prompt="Be brief.").system_prompt == "Be brief."
    with pytest.raises(ValueError, match="reasoning-gym has no dataset 'basic_arithmetics'"):
        ReasoningGymTask(dataset="basic_arithmetics")
    with pytest.raises(ValueError, match="refused dataset_config") as info:
        ReasoningGymTask(dataset_config={"min_terms": 0})
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="refused dataset_config"):
        ReasoningGymTask(dataset_config={"no_such_setting": 1})
    with pytest.raises(ValueError, match=r"\{question\}"):
        ReasoningGymTask(prompt_template="Solve it")


def test_the_boxed_variant_asks_and_scores_as_math_hard():
    from llm_pg.data.tasks import BoxedReasoningGymTask
    from llm_pg.data.tasks.math_hard import SYSTEM_PROMPT, score

    task = BoxedReasoningGymTask("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    task.bind_seed(0)
    example = task.eval_examples[0]
    assert task.messages(example)[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert example.prompt.startswith("State the final answer")
    assert example.prompt.endswith("Return only: \\boxed{NUMBER}")
    gold = example.answer
    completions = [f"\\boxed{{{gold}}}", f"so it is {gold}", "\\boxed{123456}", "no idea"]
    assert [task.score(c, example).total for c in completions] == [pytest.approx(1.1), 0.1, 0.1, 0.0]
    assert [task.score(c, example) for c in completions] == [score(c, gold) for c in completions]
    metrics = task.eval_metrics(completions, [example] * 4)
    assert metrics["exact_match"] == 0.25 and metrics["exact_match_relaxed"] == 0.5 and metrics["has_boxed"] == 0.5
    with pytest.raises(ValueError, match="reasoning-gym 'word_sorting' has answers that are not numbers"):
        BoxedReasoningGymTask("word_sorting")
