"""Environments: the contract (environment.py), replies rendered after a turn (turns.py), specs (load.py) and the
adapters to reasoning-gym (reasoning_gym.py), verifiers and OpenEnv. docs/environments.md."""
