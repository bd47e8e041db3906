#!/usr/bin/python3
"""Writes the initial seeds of plsh_fuzz: 48 byte strings of 8 to 500 bytes from a fixed seed.

tests/fuzz/corpus/ holds these seeds merged with what fuzzing found, minimised with libFuzzer's
-merge=1 (the smallest set of inputs with the same coverage).

plsh_fuzz decodes the configuration from the last bytes of an input and the data from the rest,
so random strings of these lengths cover small and large problems, both scalar types, every
slope, scale, position and layout choice, and inputs with and without non-finite entries.

    /usr/bin/python3 tests/fuzz/make_corpus.py tests/fuzz/corpus
"""
import pathlib
import random
import sys


def main() -> None:
    directory = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "corpus")
    directory.mkdir(parents=True, exist_ok=True)
    generator = random.Random(8)
    for index in range(48):
        length = generator.choice([8, 16, 24, 32, 48, 64, 96, 128, 200, 300, 500])
        data = bytes(generator.randrange(256) for _ in range(length))
        (directory / f"seed-{index:02d}").write_bytes(data)


if __name__ == "__main__":
    main()
