"""Putting it together for a front end: loading a pair, a chat session, batch items and records, bench schedules."""
