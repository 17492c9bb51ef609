import sys

from vllm_prefix_guard_harness.cli import main

sys.exit(main())
