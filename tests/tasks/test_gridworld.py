"""Gridworld: the env's dynamics, end-only reward after tens of turns, expert demonstrations."""

import pytest

from trace_jax.config import ConfigError
from trace_jax.tasks import GridProblem, Turn, demonstration_tokens, make_task, play_episode
from trace_jax.tasks.gridworld import GridEnv, parse_action

# A hand-made corridor: A at (1,1), checkpoint 1 at (1,3), goal at (3,3).
GRID = ("#####", "#A.1#", "#.#.#", "#..G#", "#####")


def _problem(max_turns=10):
    return GridProblem(
        id="x", prompt="", grid=GRID, start=(1, 1), targets=((1, 3), (3, 3)), max_turns=max_turns
    )


def test_env_dynamics_and_final_reward():
    env = GridEnv()
    assert env.reset(_problem()) == "at 1,1 next 1\n"
    assert env.step("n") == ("blocked at 1,1 next 1\n", False, 0.0)
    assert env.step("jump") == ("invalid at 1,1 next 1\n", False, 0.0)
    assert env.step("east") == ("at 1,2 next 1\n", False, 0.0)
    assert env.step(" E\n") == ("got 1 at 1,3 next G\n", False, 0.0)
    assert env.step("s") == ("at 2,3 next G\n", False, 0.0)
    assert env.step("down") == ("done\n", True, 1.0)
    with pytest.raises(RuntimeError, match="ended"):
        env.step("n")


def test_goal_before_checkpoint_does_not_count():
    env = GridEnv()
    env.reset(_problem())
    for a in ["s", "s", "e", "e"]:  # walks onto G first
        obs, done, _ = env.step(a)
    assert obs == "at 3,3 next 1\n" and not done


def test_running_out_of_turns_ends_with_zero_or_partial_credit():
    for partial, want in [(False, 0.0), (True, 0.5)]:
        env = GridEnv(partial_credit=partial)
        env.reset(_problem(max_turns=3))
        steps = [env.step(a) for a in ["e", "e", "w"]]
        assert [s[1] for s in steps] == [False, False, True]
        assert steps[-1][2] == want


def test_parse_action_aliases():
    assert [parse_action(a) for a in ["n", "UP", " north\n", "left", "x", ""]] == [
        "n",
        "n",
        "n",
        "w",
        None,
        None,
    ]


def test_demonstrations_reach_the_goal_after_tens_of_turns():
    task = make_task("long_horizon")
    assert task.multi_turn
    for split in ("train", "eval"):
        for i in range(20):
            p = task.problem(split, i)
            turns = task.demonstration_turns(p)
            moves = [t.text for t in turns if t.role == "policy"]
            assert task.config.min_path <= len(moves) <= p.max_turns
            assert turns[-1] == Turn("env", "done\n")
            assert task.reward(p, task.demonstration(p)) == 1.0


def test_expert_policy_through_play_episode():
    task = make_task("gridworld", size=5, num_checkpoints=1, min_path=6)
    p = task.problem("train", 7)
    shadow = task.env(p)

    def expert(_text):
        action = task.expert_action(p, shadow)
        shadow.step(action)
        return action

    turns, reward = play_episode(task, p, expert)
    assert reward == 1.0 and turns == task.demonstration_turns(p)


def test_wrong_moves_score_zero():
    task = make_task("gridworld")
    p = task.problem("train", 0)
    assert task.reward(p, "n\n" * p.max_turns) == 0.0
    assert task.reward(p, "") == 0.0


def test_prompt_holds_the_map_and_first_observation():
    task = make_task("gridworld", size=4, num_checkpoints=1, min_path=4)
    p = task.problem("eval", 0)
    assert "\n".join(p.grid) in p.prompt
    assert p.prompt.endswith(GridEnv().reset(p))
    assert p.grid[p.start[0]][p.start[1]] == "A"


def test_demonstration_tokens_mask_only_policy_turns():
    task = make_task("gridworld")
    p = task.problem("train", 1)
    ids, mask = demonstration_tokens(task, p)
    moves = [t.text for t in task.demonstration_turns(p) if t.role == "policy"]
    assert mask.sum() == sum(len(m) + 1 for m in moves)  # each move and its EOT
    assert (ids[mask] == 3).sum() == len(moves)


def test_deterministic_and_disjoint_splits():
    task = make_task("gridworld", size=5)
    assert task.problem("train", 5) == make_task("gridworld", size=5).problem("train", 5)
    train = {task.problem("train", i).grid for i in range(300)}
    assert not train & {task.problem("eval", i).grid for i in range(50)}


def test_slack_sets_turns_from_the_shortest_path():
    task = make_task("gridworld", slack=3)
    p = task.problem("train", 0)
    assert p.max_turns == len(task.demonstration(p).split("\n")) + 3


@pytest.mark.parametrize(
    ("knobs", "key"),
    [
        ({"size": 2}, "size"),
        ({"num_checkpoints": 10}, "num_checkpoints"),
        ({"wall_density": 0.9}, "wall_density"),
        ({"min_path": 50, "max_turns": 40}, "min_path"),
        ({"partial_credit": "yes"}, "partial_credit"),
    ],
)
def test_bad_knobs_raise_config_error_naming_the_key(knobs, key):
    with pytest.raises(ConfigError, match=key):
        make_task("gridworld", **knobs)
