"""The `casing` task family (a rollserve handler plugin) and a GRPO trainer on CPU that learns
it through rollserve's REST API: rollouts and rewards from the service, weights pushed back to
its inference fleet after every step."""
