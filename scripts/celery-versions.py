"""Print the Celery, kombu and billiard versions installed here (after the name given as the
second argument: the tox env's); exit 1 unless Celery and kombu are of the minor given as the
first (``5.3``): a compat env whose install pulled in another version would otherwise test the
wrong one in silence."""

import sys

import billiard
import celery
import kombu

label = f"{sys.argv[2]}: " if len(sys.argv) > 2 else ""
print(f"{label}celery {celery.__version__}, kombu {kombu.__version__}, "
      f"billiard {billiard.__version__}")
if len(sys.argv) > 1:
    wanted = sys.argv[1].split(".")
    for module in (celery, kombu):
        if module.__version__.split(".")[:2] != wanted:
            sys.exit(f"expected {module.__name__} {sys.argv[1]}.*, found {module.__version__}")
