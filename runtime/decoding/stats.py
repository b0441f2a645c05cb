"""What a generation measured: tokens, passes, acceptance, where the time went."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V a previous generation left (not prefilled)
    new_tokens: int = 0
    target_passes: int = 0  # verify passes (plain decoding: one per token)
    draft_passes: int = 0
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target agreed with
    proposed_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0
    first_round_tokens: int = 0  # tokens the first round committed (they arrive together)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    seconds: float = 0.0
    finish_reason: str = ""  # "eos", "length" or "stop"
    draft_len_history: list[int] = field(default_factory=list)  # k chosen each round
    last_proposed: int = 0
    last_accepted: int = 0
    tree_sizes: list[int] = field(default_factory=list)  # nodes verified each tree round (0: a plain step)
    path_lengths: list[int] = field(default_factory=list)  # the accepted path's length each tree round

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per target pass (accepted drafts plus the target's own token)."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Whole request: prompt processing included."""
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Decoding only: the tokens after the first round, over the time from its end to the last."""
        span = self.seconds - self.first_token_seconds
        return (self.new_tokens - self.first_round_tokens) / span if span > 0 else 0.0

    def record_round(self, chosen: int | None, proposed: int, accepted: int) -> None:
        if chosen is not None:
            self.draft_len_history.append(chosen)
        self.last_proposed, self.last_accepted = proposed, accepted
        grow = proposed - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted
        self.drafted += proposed
        self.accepted += accepted

    def record_tree(self, nodes: int, path: int) -> None:
        self.tree_sizes.append(nodes)
        self.path_lengths.append(path)
        self.last_proposed, self.last_accepted = nodes, path
        self.drafted += nodes
        self.accepted += path

    def as_dict(self) -> dict:
        host = self.seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "target_passes": self.target_passes,
            "draft_passes": self.draft_passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted": round(self.mean_accepted, 4),
            "acceptance_by_position": [
                round(a / p, 4) if p else None for a, p in zip(self.accepted_at, self.proposed_at)
            ],
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 2),
            "time_to_first_token": round(self.first_token_seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "host_seconds": round(max(host, 0.0), 4),
            "finish_reason": self.finish_reason,
            "draft_len_history": self.draft_len_history,
            "draft_len_histogram": _histogram(self.draft_len_history),
            "tree_rounds": len(self.tree_sizes),
            "tree_size_histogram": _histogram(self.tree_sizes),
            "accepted_path_histogram": _histogram(self.path_lengths),
        }


def _histogram(values: list[int]) -> dict[str, int]:
    return {str(k): values.count(k) for k in sorted(set(values))}
