"""The methods beside the core: each sibling method's rewards, estimators, loss terms, rollout
controller and trainer side, one module (or one package) per method (docs/architecture.md,
"Layers"). TurnSight and MatchTIR still live in the core (`rl/turnsight.py`, `rl/views.py`,
`rewards.py`), and the core still imports some of these modules directly: the list, which may only
shrink, is pinned by tests/test_package_layout.py."""
