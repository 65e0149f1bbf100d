import os
import sys

# The tests' helpers (ranks, models, workers) import each other by name, in the test
# process and in the rank processes it starts.
sys.path.insert(0, os.path.dirname(__file__))
