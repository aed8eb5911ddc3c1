"""dsauto's version, in one place: the package metadata reads it from here (pyproject.toml), and
so do the profiles, which record the versions they were measured with."""

__version__ = "0.2.0"  # 0.2: the reference layers compute norms as Hugging Face does (profiles of 0.1 measured torch's)
