"""The messages of one engine step: the plan the scheduler hands the runner, the runner's output,
and the result the core hands back to the scheduler."""
