import raggedvl


def test_every_root_export_resolves():
    for name in raggedvl.__all__:
        obj = getattr(raggedvl, name)
        assert obj.__name__ == name
