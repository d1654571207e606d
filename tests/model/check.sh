#!/usr/bin/env bash
# Checks the abort-acknowledgement model and its mutants with spin; prints one
# JSON line per check (model, property, errors, states, seconds). Exit status 0
# when the protocol verifies and every mutant and stated limit (a crashed remote
# writer, a write landing after its process is gone) yields a counterexample.
set -euo pipefail
cd "$(dirname "$0")"
exec python3 spin_runner.py
