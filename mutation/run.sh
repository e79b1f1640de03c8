#!/usr/bin/env bash
# Mutation testing of meshlm's core with mutmut (docs/mutation.md). Not run by CI.
#
#   pip install -e ".[test,mutation]"
#   mutation/run.sh                    # every mutant of the core (hours on 2 cores)
#   mutation/run.sh "meshlm.runtime.optim.sharded*"    # one module, or any of mutmut's mutant-name globs
#   mutmut results; mutmut show <mutant>
#   MUTATION_TESTS=unit mutation/run.sh "meshlm.runtime.bucket.x__pack*"
#                                      # tests/unit only, in mutants-unit/ (mutation/unit_tree.py);
#                                      # run mutmut results / show there
#
# The configuration is [tool.mutmut] in pyproject.toml. mutmut writes the mutated copy, its
# results and caches under mutants/ (git-ignored); a later run reuses them and checks only
# the mutants without a result, or the ones named. MUTMUT_CHILDREN (default 1) mutants run
# at once; each may start process pools of 2 or 4 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${MUTATION_TESTS:-all}" = unit ]; then
  python mutation/unit_tree.py
  cd mutants-unit
fi
exec nice -n 10 mutmut run --max-children "${MUTMUT_CHILDREN:-1}" "$@"
