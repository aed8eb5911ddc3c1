"""What each engine can run and how it names things, shared by the emitters and the runtime hooks.

A rule or a spelling that both the writer of an engine's configuration (:mod:`dsauto.emit`) and the
code applying a plan inside that engine (:mod:`dsauto.runtime`) need lives here once, so that the
two can never read a plan differently. It depends on the plan only. :mod:`dsauto.engines.megatron_args`
reads the other way, a Megatron-LM launch's flags into what dsauto plans from, with the same
spellings.
"""
