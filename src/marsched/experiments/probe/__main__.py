import sys

from marsched.experiments.probe.run import main

if __name__ == "__main__":
    sys.exit(main())
