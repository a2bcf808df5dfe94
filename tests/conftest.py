import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# tests/ holds shared helpers (tb_process) imported by the test modules.
sys.path.insert(0, os.path.dirname(__file__))
