"""Reward functions as a user would install them (steps/scoring/user_reward.py's contract), for the tests."""

import math
import time


def length_bonus(prompt, response, answer, metadata):
    return {"reward": 1.0 if answer.split()[-1] in response else 0.0, "length": float(len(response)),
            "level": float(metadata.get("level", 0))}


def plain(prompt, response, answer, metadata):
    print("a user's print goes to the log, not the protocol")
    return 0.5 if isinstance(prompt, list) else 0.25


def raises(prompt, response, answer, metadata):
    raise KeyError("gold")


def hangs(prompt, response, answer, metadata):
    time.sleep(60)
    return 0.0


def not_finite(prompt, response, answer, metadata):
    return math.nan


def wrong_type(prompt, response, answer, metadata):
    return "1.0"
