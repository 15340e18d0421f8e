"""Long-horizon task: walk a text grid through numbered checkpoints in order, then to the goal.

The prompt shows the map (``#`` wall, ``.`` floor, ``A`` start, ``1``-``9`` checkpoints, ``G``
goal) and the first observation. Each policy turn is one move, ``n``/``s``/``e``/``w`` (``up``,
``down``, ``right``, ``left`` and ``north``... are accepted too); the environment answers with a
short observation line, e.g.::

    at 2,3 next 1          (moved; row 2, column 3; the next target is checkpoint 1)
    blocked at 2,3 next 1  (a wall; the position did not change)
    got 1 at 4,3 next G    (reached checkpoint 1)
    invalid at 2,3 next 1  (the action was not a move)
    done                   (reached the goal after every checkpoint; the episode ends)

The reward comes only at the end: 1 for reaching the goal through every checkpoint in order
within ``max_turns`` moves, else 0 (or, with ``partial_credit``, the fraction of targets
reached). Shortest solutions take tens of moves on the default maps.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque

from trace_jax.tasks.base import (
    UNBOUNDED,
    Problem,
    Split,
    Turn,
    check_eval_fraction,
    check_index,
    check_split,
    draw_in_split,
    register_task,
    require,
)

MOVES = {"n": (-1, 0), "s": (1, 0), "e": (0, 1), "w": (0, -1)}
_ALIASES = {
    "n": "n", "north": "n", "up": "n", "u": "n",
    "s": "s", "south": "s", "down": "s", "d": "s",
    "e": "e", "east": "e", "right": "e", "r": "e",
    "w": "w", "west": "w", "left": "w", "l": "w",
}  # fmt: skip
Cell = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class GridProblem(Problem):
    """Attributes:
    grid: the map rows (walls around the border).
    start: the agent's start cell (row, column).
    targets: checkpoint cells in visiting order, then the goal cell.
    max_turns: moves allowed.
    """

    grid: tuple[str, ...]
    start: Cell
    targets: tuple[Cell, ...]
    max_turns: int


@dataclasses.dataclass(frozen=True)
class GridworldConfig:
    """Attributes:
    size: interior side length of the square map (walls are added around it).
    num_checkpoints: numbered checkpoints to visit in order before the goal (0-9).
    wall_density: fraction of interior cells that are walls.
    min_path: shortest solution length a map must have (moves); maps are redrawn until it holds.
    max_turns: moves allowed per episode; must exceed the longest possible shortest path.
    slack: alternative to a fixed ``max_turns``: if set, allow shortest path + slack moves.
    partial_credit: reward = fraction of targets reached (instead of 1/0 for finishing).
    eval_fraction: share of the map space held out for eval (by content hash).
    eval_size: number of eval problems.
    seed: the problem set's seed.
    """

    size: int = 6
    num_checkpoints: int = 2
    wall_density: float = 0.2
    min_path: int = 12
    max_turns: int = 40
    slack: int | None = None
    partial_credit: bool = False
    eval_fraction: float = 0.1
    eval_size: int = 128
    seed: int = 0

    def __post_init__(self):
        require(3 <= self.size <= 16, "size", f"must be in [3, 16], got {self.size}")
        require(
            0 <= self.num_checkpoints <= 9,
            "num_checkpoints",
            f"must be in [0, 9], got {self.num_checkpoints}",
        )
        require(
            self.num_checkpoints + 2 <= self.size * self.size // 2,
            "num_checkpoints",
            f"too many for a {self.size}x{self.size} map",
        )
        require(
            0.0 <= self.wall_density <= 0.4,
            "wall_density",
            f"must be in [0, 0.4], got {self.wall_density}",
        )
        require(self.min_path >= 1, "min_path", f"must be >= 1, got {self.min_path}")
        require(self.max_turns >= 1, "max_turns", f"must be >= 1, got {self.max_turns}")
        if self.slack is None:
            require(
                self.min_path <= self.max_turns,
                "min_path",
                f"{self.min_path} exceeds max_turns={self.max_turns}",
            )
        else:
            require(self.slack >= 0, "slack", f"must be >= 0, got {self.slack}")
        check_eval_fraction(self.eval_fraction)
        require(self.eval_size >= 1, "eval_size", f"must be >= 1, got {self.eval_size}")


def parse_action(action: str) -> str | None:
    """``" North\\n"`` -> ``"n"``; None if the text is not a move."""
    return _ALIASES.get(action.strip().lower())


def shortest_path(grid: tuple[str, ...], start: Cell, goal: Cell) -> list[str] | None:
    """Moves of a shortest path from ``start`` to ``goal`` (BFS, fixed n/s/e/w order)."""
    prev: dict[Cell, tuple[Cell, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            moves = []
            while prev[cell] is not None:
                cell, m = prev[cell]  # type: ignore[misc]
                moves.append(m)
            return moves[::-1]
        for m, (dr, dc) in MOVES.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if grid[nxt[0]][nxt[1]] != "#" and nxt not in prev:
                prev[nxt] = (cell, m)
                queue.append(nxt)
    return None


def expert_moves(grid: tuple[str, ...], start: Cell, targets: tuple[Cell, ...]) -> list[str]:
    """Shortest moves visiting ``targets`` in order (each leg a shortest path)."""
    moves, at = [], start
    for t in targets:
        leg = shortest_path(grid, at, t)
        if leg is None:
            raise ValueError(f"target {t} unreachable from {at}")
        moves += leg
        at = t
    return moves


def target_name(index: int, num_targets: int) -> str:
    return "G" if index == num_targets - 1 else str(index + 1)


class GridEnv:
    """The environment of one episode: ``reset(problem)``, then ``step(action)`` per turn."""

    def __init__(self, partial_credit: bool = False):
        self.partial_credit = partial_credit
        self.problem: GridProblem | None = None
        self.max_turns = 0

    def reset(self, problem: GridProblem) -> str:
        self.problem = problem
        self.max_turns = problem.max_turns
        self.pos = problem.start
        self.reached = 0
        self.turns = 0
        self.done = False
        return self._observe("at")

    def _observe(self, what: str) -> str:
        p = self.problem
        if self.reached == len(p.targets):
            return "done\n"
        nxt = target_name(self.reached, len(p.targets))
        return f"{what} {self.pos[0]},{self.pos[1]} next {nxt}\n"

    def _final_reward(self) -> float:
        n = len(self.problem.targets)
        if self.partial_credit:
            return self.reached / n
        return 1.0 if self.reached == n else 0.0

    def step(self, action: str) -> tuple[str, bool, float]:
        if self.problem is None:
            raise RuntimeError("GridEnv.step before reset")
        if self.done:
            raise RuntimeError("GridEnv.step after the episode ended")
        self.turns += 1
        move = parse_action(action)
        if move is None:
            what = "invalid at"
        else:
            dr, dc = MOVES[move]
            nxt = (self.pos[0] + dr, self.pos[1] + dc)
            if self.problem.grid[nxt[0]][nxt[1]] == "#":
                what = "blocked at"
            else:
                self.pos = nxt
                what = "at"
                if nxt == self.problem.targets[self.reached]:
                    what = f"got {target_name(self.reached, len(self.problem.targets))} at"
                    self.reached += 1
        obs = self._observe(what)
        self.done = self.reached == len(self.problem.targets) or self.turns >= self.max_turns
        return obs, self.done, self._final_reward() if self.done else 0.0


@register_task("gridworld", "long_horizon", config=GridworldConfig)
class GridworldTask:
    """Multi-turn grid navigation through ordered checkpoints; see the module docstring."""

    name = "gridworld"
    multi_turn = True

    def __init__(self, config: GridworldConfig = GridworldConfig()):
        self.config = config

    def num_problems(self, split: Split) -> int:
        return UNBOUNDED if check_split(split) == "train" else self.config.eval_size

    def problem(self, split: Split, index: int) -> GridProblem:
        c = self.config
        index = check_index(index, self.num_problems(check_split(split)), split)
        grid, start, targets, length = draw_in_split(
            self._generate_map,
            task=self.name,
            seed=c.seed,
            split=split,
            index=index,
            eval_fraction=c.eval_fraction,
        )
        max_turns = c.max_turns if c.slack is None else length + c.slack
        env = GridEnv()
        first = env.reset(GridProblem("", "", grid, start, targets, max_turns))
        names = ", ".join(str(i + 1) for i in range(len(targets) - 1))
        order = f"Visit {names} in order, then G." if names else "Go to G."
        prompt = (
            f"{order} Moves: n s e w. At most {max_turns} moves.\n" + "\n".join(grid) + "\n" + first
        )
        return GridProblem(
            id=f"{self.name}/{split}/{index}",
            prompt=prompt,
            grid=grid,
            start=start,
            targets=targets,
            max_turns=max_turns,
        )

    def _generate_map(self, rng: random.Random):
        c = self.config
        n = c.size
        for _ in range(1000):
            cells = [(r, col) for r in range(1, n + 1) for col in range(1, n + 1)]
            rng.shuffle(cells)
            k = c.num_checkpoints + 2
            start, targets = cells[0], tuple(cells[1:k])  # checkpoints in order, then the goal
            walls = set(cells[k : k + round(c.wall_density * n * n)])
            rows = []
            for r in range(n + 2):
                row = ""
                for col in range(n + 2):
                    border = r in (0, n + 1) or col in (0, n + 1)
                    row += "#" if border or (r, col) in walls else "."
                rows.append(row)
            grid = tuple(rows)
            try:
                length = len(expert_moves(grid, start, targets))
            except ValueError:
                continue
            max_turns = c.max_turns if c.slack is None else length + c.slack
            if length < c.min_path or length > max_turns:
                continue
            shown = [list(row) for row in grid]
            shown[start[0]][start[1]] = "A"
            for i, t in enumerate(targets):
                shown[t[0]][t[1]] = target_name(i, len(targets))
            grid = tuple("".join(row) for row in shown)
            return "\n".join(grid), (grid, start, targets, length)
        raise RuntimeError(
            f"gridworld: no map with a shortest path in [min_path={c.min_path}, max_turns] "
            f"after 1000 draws; lower min_path or raise max_turns"
        )

    def env(self, problem: GridProblem) -> GridEnv:
        env = GridEnv(partial_credit=self.config.partial_credit)
        env.reset(problem)
        return env

    def expert_action(self, problem: GridProblem, env: GridEnv) -> str:
        """The move a shortest-path expert makes from the env's current state."""
        return expert_moves(problem.grid, env.pos, problem.targets[env.reached :])[0]

    def demonstration_turns(self, problem: GridProblem) -> list[Turn]:
        env = self.env(problem)
        turns = []
        for move in expert_moves(problem.grid, problem.start, problem.targets):
            obs, done, _ = env.step(move)
            turns += [Turn("policy", move), Turn("env", obs)]
            if done:
                break
        return turns

    def demonstration(self, problem: GridProblem) -> str:
        """The expert's moves, one per line (``reward`` replays this form)."""
        return "\n".join(t.text for t in self.demonstration_turns(problem) if t.role == "policy")

    def reward(self, problem: GridProblem, completion: str) -> float:
        """Replay ``completion`` as moves, one per line, in a fresh env; the final reward."""
        env = self.env(problem)
        reward = 0.0
        for line in completion.split("\n"):
            if not line.strip():
                continue
            _, done, reward = env.step(line)
            if done:
                return reward
        return env._final_reward() if self.config.partial_credit else 0.0
