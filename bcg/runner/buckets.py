"""Bucket ladders: the sizes graphs are captured for. A batch replays the smallest bucket
that fits it, so the ladder trades capture time and pool memory against padding waste."""

from __future__ import annotations

DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 512)
PREFILL_TOKENS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def ladder(requested: tuple[int, ...] | None, default: tuple[int, ...], limit: int) -> list[int]:
    """The requested sizes, or the default ladder up to `limit` with `limit` itself on top."""
    if requested is not None:
        too_big = [size for size in requested if size > limit]
        if too_big or any(size < 1 for size in requested):
            raise ValueError(
                f"graph bucket sizes must be in 1..{limit} (the step's limit), got "
                f"{sorted(requested)}; drop {too_big or 'the sizes below 1'} or raise the limit"
            )
        return sorted(set(requested))
    return sorted({size for size in default if size < limit} | {limit})

