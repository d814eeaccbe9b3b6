"""GET /metrics: the engine snapshot as Prometheus text exposition."""

from __future__ import annotations

from bcg.server.engine_loop import EngineSnapshot


def render_metrics(snap: EngineSnapshot, model_name: str) -> str:
    model = f'model="{_escape(model_name)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP bcg_{name} {help}")
        lines.append(f"# TYPE bcg_{name} {kind}")
        for labels, value in samples:
            lines.append(f"bcg_{name}{{{labels}}} {value}")

    metric("requests_total", "counter", "engine requests accepted (one per choice)",
           [(model, snap.num_requests)])
    metric("requests_finished_total", "counter", "engine requests finished, by reason",
           [(f'{model},reason="{reason}"', count) for reason, count in snap.finished.items()])
    metric("prompt_tokens_total", "counter", "prompt tokens accepted",
           [(model, snap.num_prompt_tokens)])
    metric("generation_tokens_total", "counter", "tokens generated",
           [(model, snap.num_generation_tokens)])
    metric("num_requests_running", "gauge", "requests being computed",
           [(model, snap.num_running)])
    metric("num_requests_waiting", "gauge", "requests waiting to be scheduled",
           [(model, snap.num_waiting)])
    metric("kv_cache_usage", "gauge", "fraction of KV cache blocks in use (0 to 1)",
           [(model, snap.kv_cache_usage)])
    metric("forwards_total", "counter", "model forwards, by path (graph kind or eager)",
           [(f'{model},path="{_escape(path)}"', count) for path, count in snap.forwards.items()])
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
