"""The plugin system: entry points and pluggy hooks (``registry``), the engines' verified version ranges
(``versions``) and the optional extras' install hints (``optional``).

Users reach it through ``genengine.create_engine`` / ``available_backends``; this package itself imports nothing.
"""
