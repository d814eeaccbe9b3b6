"""EleutherAI's lm-eval harness against `bcg serve` (its `local-completions` backend, the
tokenizer read through the server's /tokenizer_info, /tokenize and /detokenize) and against
its own `hf` backend on the same GGUF, offline: equal scores, loglikelihoods within 1e-3.

A multiple-choice task (loglikelihood requests: token-id prompts, echo, logprobs) and a
generate-until task (stops are the server's), whose JSONL data the test writes.
"""

import json
import os

import pytest

from tests.builtin_model import require_builtin_model
from tests.server_process import running_server

lm_eval = pytest.importorskip("lm_eval")

MC_DOCS = [
    {"question": "What is the capital of France?", "choices": [" Paris", " London", " Berlin"],
     "answer": 0},
    {"question": "How many legs does a spider have?", "choices": [" six", " eight", " four"],
     "answer": 1},
    {"question": "What color is the sky on a clear day?",
     "choices": [" green", " red", " blue"], "answer": 2},
    {"question": "Which animal says moo?", "choices": [" a cow", " a cat", " a dog"],
     "answer": 0},
]
GEN_DOCS = [{"question": "The capital of France is", "answer": " Paris"},
            {"question": "One, two, three,", "answer": " four"}]
TOLERANCE = 1e-3


def write_tasks(folder) -> str:
    """Two tasks over local JSONL files; returns the folder to include."""
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    data = lambda name: f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " \
                        f"{folder / name}.jsonl\ntest_split: test\n"
    (folder / "bcg_mc.yaml").write_text(
        "task: bcg_mc\n" + data("mc") + "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n")
    (folder / "bcg_gen.yaml").write_text(
        "task: bcg_gen\n" + data("gen") + "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n  until: [\",\", \".\", \"\\n\"]\n  max_gen_toks: 12\n"
        "  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")
    return str(folder)


def evaluate(model: str, model_args: str, tasks_folder: str) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=["bcg_mc", "bcg_gen"],
        task_manager=TaskManager(include_path=tasks_folder), log_samples=True, device="cpu")


def scores(result: dict) -> dict:
    return {task: {k: v for k, v in metrics.items() if "stderr" not in k and "," in k}
            for task, metrics in result["results"].items()}


def loglikelihoods(result: dict) -> list[float]:
    return [ll for sample in result["samples"]["bcg_mc"] for ll, _ in sample["filtered_resps"]]


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def test_lm_eval_scores_bcg_serve_like_its_hf_backend(tmp_path):
    gguf = require_builtin_model()
    tasks = write_tasks(tmp_path)
    hf = evaluate("hf", f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32", tasks)
    with running_server(["--max-model-len", "512"]) as base:
        served = evaluate(
            "local-completions",
            f"base_url={base}/v1/completions,model=SmolLM2-135M-Instruct,tokenizer_backend=remote,"
            "tokenized_requests=True,num_concurrent=1,max_retries=1", tasks)
    assert scores(served) == scores(hf)
    ours, reference = loglikelihoods(served), loglikelihoods(hf)
    assert len(ours) == len(reference) == sum(len(d["choices"]) for d in MC_DOCS)
    assert max(abs(a - b) for a, b in zip(ours, reference, strict=True)) <= TOLERANCE
    generated = [s["filtered_resps"] for s in served["samples"]["bcg_gen"]]
    assert generated == [s["filtered_resps"] for s in hf["samples"]["bcg_gen"]]
    assert os.environ["HF_HUB_OFFLINE"] == "1"
