"""`-n auto`: how many tokens to draft each step, and what is kept between runs."""
