"Fixtures shared by more than one test file."
import pytest


@pytest.fixture(scope="session")
def docs_site(tmp_path_factory):
    "The documentation site built once (into a temporary folder): `(notebooks, site folder)`, see `test_docs.build_site`."
    from test_docs import build_site
    return build_site(tmp_path_factory.mktemp("docs"))
