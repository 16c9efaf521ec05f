"""Weighted sums of scores, for a reward built from several scorers (format plus accuracy)."""

from reward_svc.scorers.base import Score


def weighted_sum(parts: list[tuple[str, float, Score]]) -> Score:
    """Combines named scores: the score is the sum of weight * score, each turn's reward the
    sum of weight * that part's reward for the turn, and each part's score, weight and extras
    land under its name, e.g.
    `{"format": {"score": 1.0, "weight": 0.2, "extras": {"tool_calls": 2, ...}}, "gsm8k": ...}`.

    Raises ValueError when there are no parts or two share a name.
    """
    if not parts:
        raise ValueError("weighted_sum needs at least one (name, weight, score) part; got none")
    names = [name for name, _, _ in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"weighted_sum part names {names!r} repeat; each name must be unique")
    turn_rewards: dict[int, float] = {}
    for _, weight, part in parts:
        for turn, value in part.turn_rewards.items():
            turn_rewards[turn] = turn_rewards.get(turn, 0.0) + weight * value
    return Score(
        score=sum(weight * part.score for _, weight, part in parts),
        extras={
            name: {"score": part.score, "weight": weight, "extras": part.extras}
            for name, weight, part in parts
        },
        turn_rewards=turn_rewards,
    )
