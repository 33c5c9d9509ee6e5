"""The Python tests' check(): a failed condition is printed and recorded in `failures`; each test exits non-zero when
`failures` is not empty. No other dependency, so scripts' tests that run without a nopad build can use it too."""
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)
