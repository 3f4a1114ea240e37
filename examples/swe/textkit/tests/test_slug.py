from textkit import slugify


def test_words_are_joined_with_dashes():
    assert slugify("Hello World") == "hello-world"


def test_accents_are_dropped():
    assert slugify("Café Crème") == "cafe-creme"


def test_custom_separator():
    assert slugify("a b  c", separator="_") == "a_b_c"
