#!/usr/bin/env bash
# Formatting check, as CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
