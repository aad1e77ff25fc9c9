"""The greedy exactness check: greedy outputs must be identical token for token; where two
are not, say where they first part (prompt, position, the tokens on each side)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

SHOWN_TOKENS = 4  # tokens shown from the divergence on


@dataclass(frozen=True)
class Divergence:
    prompt: str
    checked: str  # the output checked, e.g. "specdec draft model k=3"
    reference: str  # the output it must equal, e.g. "specdec target alone"
    position: int  # index (in the generated tokens) of the first token that differs
    checked_tokens: tuple[int, ...]  # up to SHOWN_TOKENS tokens of each from there
    reference_tokens: tuple[int, ...]

    def describe(self) -> str:
        return (
            f"{self.checked} vs {self.reference} on {self.prompt}: first differs at token {self.position} "
            f"({list(self.checked_tokens)} vs {list(self.reference_tokens)})"
        )

    def to_json(self) -> dict:
        return asdict(self)


def first_divergence(checked: list[int], reference: list[int]) -> int | None:
    """The index of the first position where the two token lists differ (one ending before
    the other counts: the position is the shorter one's length); None if they are identical."""
    for position, (a, b) in enumerate(zip(checked, reference)):
        if a != b:
            return position
    return None if len(checked) == len(reference) else min(len(checked), len(reference))


def compare(
    prompt: str, checked_name: str, checked: list[int], reference_name: str, reference: list[int]
) -> Divergence | None:
    """A Divergence where checked differs from reference, else None."""
    position = first_divergence(checked, reference)
    if position is None:
        return None
    return Divergence(
        prompt,
        checked_name,
        reference_name,
        position,
        tuple(checked[position : position + SHOWN_TOKENS]),
        tuple(reference[position : position + SHOWN_TOKENS]),
    )
