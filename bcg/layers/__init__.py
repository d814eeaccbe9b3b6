"""Model building blocks: attention (the graph break point), linear, norm, rotary, sampler."""
