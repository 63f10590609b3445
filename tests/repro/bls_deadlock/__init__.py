"""The python backend BLS deadlock: tiny models, a driver (run.py) and docs/upstream/python-backend-bls-deadlock.md."""
