"""Helpers the tests share (servers, prompts, pools, statistics); no test lives here."""
