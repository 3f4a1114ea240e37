from textkit import camel_to_snake, snake_to_camel


def test_camel_to_snake():
    assert camel_to_snake("parseHttpHeader") == "parse_http_header"


def test_snake_to_camel():
    assert snake_to_camel("parse_http_header") == "parseHttpHeader"


def test_round_trip():
    assert camel_to_snake(snake_to_camel("read_all_lines")) == "read_all_lines"
