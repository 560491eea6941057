"""Named MoE layer shapes used by the benchmark and the tests.

H: hidden size, I: expert intermediate size, E: number of experts (over all EP ranks),
k: experts per token. The Qwen3 shapes are those of the released checkpoints; "tiny" is
small enough for the CPU reference to run in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    name: str
    H: int
    I: int  # noqa: E741 -- the design's name for the intermediate size
    E: int
    k: int

    def forward_flops(self, num_tokens: int) -> int:
        """FLOPs of one forward over num_tokens tokens: per (token, expert) pair, L1 is
        2*H*2I and L2 is 2*I*H, so 6*H*I (SwiGLU and the combine are not counted)."""
        return 6 * num_tokens * self.k * self.H * self.I


PRESETS: dict[str, MoEShape] = {
    shape.name: shape
    for shape in (
        MoEShape("qwen3-30b-a3b", H=2048, I=768, E=128, k=8),
        MoEShape("qwen3-235b-a22b", H=4096, I=1536, E=128, k=8),
        MoEShape("tiny", H=64, I=32, E=8, k=2),
    )
}


def get_preset(name: str) -> MoEShape:
    """The preset called `name`; a ValueError naming the valid presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        valid = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown model preset {name!r}; valid presets: {valid}") from None
