"""`python -m nonstop.config.reference > docs/configuration.md` writes the configuration reference."""

from .docgen import reference_markdown

if __name__ == "__main__":
    print(reference_markdown(), end="")
