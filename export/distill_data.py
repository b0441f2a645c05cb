"""Prompts a draft learns from: ours, plus text that ships with every Python.

Nothing is downloaded. Three kinds, as the drafts serve them: chat (questions on a list of
topics), code (tasks, and functions of the standard library to explain) and summaries of
given text (paragraphs of the standard library's module docstrings). The benchmark prompts
(`benchmarks/prompts_varied.txt`) are not among them: the figures measured on those are
held out.
"""
from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "earthquakes", "the moon's phases",
    "vaccines", "the immune system", "DNA", "evolution", "climate change", "renewable energy", "solar panels",
    "wind turbines", "electric cars", "batteries", "the internet", "email", "encryption", "passwords",
    "cloud computing", "databases", "operating systems", "compilers", "machine learning", "neural networks",
    "recursion", "sorting algorithms", "binary numbers", "version control", "unit testing", "open source software",
    "the Roman Empire", "the printing press", "the industrial revolution", "democracy", "inflation", "interest rates",
    "budgeting", "saving for retirement", "healthy sleep", "drinking enough water", "running", "yoga", "meditation",
    "learning a language", "public speaking", "time management", "remote work", "job interviews", "writing a CV",
    "baking bread", "making coffee", "growing tomatoes", "composting", "keeping houseplants alive", "adopting a cat",
    "training a dog", "bird migration", "coral reefs", "rainforests", "deserts", "the Arctic", "honey bees",
    "chess", "jazz", "the guitar", "photography", "painting with watercolours", "reading more books",
    "the metric system", "prime numbers", "probability", "the Pythagorean theorem", "gravity", "magnets",
    "light and colour", "sound waves", "airplanes", "trains", "bicycles", "recycling plastic", "tea",
]

CHAT = [
    "Explain {} in simple terms.",
    "What is {}? Answer in a short paragraph.",
    "Give me three interesting facts about {}.",
    "What are the pros and cons of {}?",
    "Write a short paragraph for a school newsletter about {}.",
    "I am a beginner. How should I get started with {}?",
]

TASKS = [
    "reverses a string", "counts the vowels in a string", "returns the largest number in a list",
    "removes duplicates from a list while keeping the order", "checks whether a number is prime",
    "computes the factorial of n", "merges two sorted lists", "flattens a nested list",
    "counts how often each word occurs in a text", "converts Celsius to Fahrenheit",
    "returns the median of a list of numbers", "checks whether two strings are anagrams",
    "reads a CSV file and returns its rows as dictionaries", "finds the second smallest element of a list",
    "capitalizes the first letter of every word", "returns the sum of the digits of an integer",
    "validates an email address with a regular expression", "computes the greatest common divisor",
    "splits a list into chunks of size n", "returns the n most common elements of a list",
    "implements binary search", "transposes a matrix given as a list of lists",
    "converts a Roman numeral to an integer", "checks whether brackets in a string are balanced",
    "computes the running average of a stream of numbers", "parses a date string in ISO format",
    "returns all permutations of a short list", "rotates a list by k positions",
    "finds the longest word in a sentence", "groups a list of words by their first letter",
]

CODE = [
    "Write a Python function that {}.",
    "Write a Python function that {}, with a docstring and type hints.",
    "Show how to write a JavaScript function that {}.",
    "Write a Python function that {}, and explain how it works.",
]

EXPLAIN = ["Explain what this Python code does:\n{}", "Find possible bugs in this Python function:\n{}"]

SUMMARISE = [
    "Summarize in one sentence: {}",
    "Summarize in two sentences: {}",
    "Give the key points of this text as a bullet list: {}",
    "Explain this text to a beginner: {}",
]


def _stdlib_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _parse(path: Path):
    try:
        return ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return None


def stdlib_paragraphs(min_chars: int = 200, max_chars: int = 700) -> list[str]:
    """Prose paragraphs of the standard library's module docstrings."""
    out = []
    for path in _stdlib_files():
        tree = _parse(path)
        doc = ast.get_docstring(tree) if tree else None
        for para in (doc or "").split("\n\n"):
            para = " ".join(para.split())
            prose = sum(c.isalpha() or c == " " for c in para) / max(1, len(para))
            if min_chars <= len(para) <= max_chars and prose > 0.9:
                out.append(para)
    return out


def stdlib_functions(min_lines: int = 4, max_lines: int = 20, per_file: int = 2) -> list[str]:
    """Short top-level functions of the standard library, as source text."""
    out = []
    for path in _stdlib_files():
        tree = _parse(path)
        if tree is None:
            continue
        source = path.read_text(encoding="utf-8", errors="replace").splitlines()
        taken = 0
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                out.append("\n".join(source[node.lineno - 1 : node.end_lineno]))
                taken += 1
                if taken == per_file:
                    break
    return out


def training_prompts(seed: int) -> list[str]:
    """Every prompt, in an order fixed by `seed`."""
    prompts = [t.format(topic) for topic in TOPICS for t in CHAT]
    prompts += [t.format(task) for task in TASKS for t in CODE]
    prompts += [t.format(code) for i, code in enumerate(stdlib_functions()) for t in EXPLAIN[i % 2 : i % 2 + 1]]
    prompts += [SUMMARISE[i % len(SUMMARISE)].format(p) for i, p in enumerate(stdlib_paragraphs())]
    random.Random(seed).shuffle(prompts)
    return prompts
