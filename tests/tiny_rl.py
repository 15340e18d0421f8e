"""Command-line overrides that make the RL configs tiny, shared by the tests that run them
(tests/experiments/test_cli.py through the entry point, tests/rl/test_loop.py's multi-turn
rollouts): equal configs compile their programs once, later runs load them from the
persistent compilation cache."""

SMALL_RL = [
    "steps=2",
    "warm_start.steps=1",
    "warm_start.batch=2",
    "prompts_per_step=2",
    "group_size=2",
    "eval_every=2",
    "eval_problems=4",  # a rollout batch: the greedy evaluation prefills with its program
    "tensorboard=false",
    "model_overrides={num_layers: 1, dtype: bfloat16}",
]

# configs/long_horizon/fp4_trace.yaml with episodes of at most 3 turns
LONG_HORIZON = (
    "configs/long_horizon/fp4_trace.yaml",
    [
        *SMALL_RL,
        "max_turns=3",
        "task.args.max_turns=3",
        "task.args.min_path=2",
        "eval_problems=0",
    ],
)
