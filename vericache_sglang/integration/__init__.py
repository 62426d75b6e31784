"""SGLang's boundary: every touch of an SGLang internal that no public seam reaches goes through
here, is checked at startup and is listed in docs/sglang-hooks.md. `hooks` wraps named functions
through SGLang's `HookRegistry`; `internals` declares the rest (a method wrapped on one
instance, a private method called, a class or module attribute set)."""
