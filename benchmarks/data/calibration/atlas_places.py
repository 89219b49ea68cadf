"""Places for make_atlas.py: countries' capitals, continents, languages, currencies and
nationalities; states' and provinces' capitals; landmarks, cities and rivers.

Written for tokentrail, released under the project's MIT licence: the facts are common
knowledge; the selection and the accepted alternatives are ours (see make_atlas.py).
"""

from __future__ import annotations

from make_knowledge import table

#: Accepted besides a country's name (its leading "the" dropped).
COUNTRY_ALSO = {
    "United Kingdom": ["UK", "Britain"], "United States": ["USA", "U.S.", "America"],
    "Netherlands": ["Holland"], "Czech Republic": ["Czechia"], "Myanmar": ["Burma"],
    "Turkey": ["Türkiye", "Turkiye"], "North Macedonia": ["Macedonia"],
    "Bosnia and Herzegovina": ["Bosnia"], "Timor-Leste": ["East Timor"],
    "Democratic Republic of the Congo": ["DR Congo", "DRC", "Congo"],
    "United Arab Emirates": ["UAE", "Emirates"], "South Korea": ["Republic of Korea"],
    "North Korea": ["DPRK"],
}


def country(name: str) -> list[str]:
    """A country's accepted names: 'the United Kingdom' -> United Kingdom, UK, Britain."""
    name = name.removeprefix("the ")
    return [name, *COUNTRY_ALSO.get(name, [])]


def countries(names: list[str]) -> list[str]:
    """Every listed country's accepted names, in order, each once."""
    return list(dict.fromkeys(a for n in names for a in country(n)))


#: Capitals besides make_sets.CAPITALS (whose capitals are asked about too).
MORE_CAPITALS = {
    "Albania": "Tirana", "North Macedonia": "Skopje", "Bosnia and Herzegovina": "Sarajevo",
    "Montenegro": "Podgorica", "Moldova": "Chisinau", "Malta": "Valletta",
    "Cyprus": "Nicosia", "Cameroon": "Yaoundé", "Botswana": "Gaborone",
    "Namibia": "Windhoek", "the Democratic Republic of the Congo": "Kinshasa",
    "Gabon": "Libreville", "Niger": "Niamey", "Chad": "N'Djamena",
    "Burkina Faso": "Ouagadougou", "Sierra Leone": "Freetown", "Liberia": "Monrovia",
    "Malawi": "Lilongwe", "Eritrea": "Asmara", "South Sudan": "Juba", "Togo": "Lomé",
    "Mauritania": "Nouakchott", "Bhutan": "Thimphu", "Myanmar": "Naypyidaw",
    "Turkmenistan": "Ashgabat", "Kyrgyzstan": "Bishkek", "Tajikistan": "Dushanbe",
    "the United Arab Emirates": "Abu Dhabi", "Bahrain": "Manama",
    "the Dominican Republic": "Santo Domingo", "Haiti": "Port-au-Prince",
    "El Salvador": "San Salvador", "Belize": "Belmopan", "the Bahamas": "Nassau",
    "Trinidad and Tobago": "Port of Spain", "Guyana": "Georgetown",
    "Suriname": "Paramaribo", "Samoa": "Apia", "Tonga": "Nuku'alofa",
    "Vanuatu": "Port Vila", "the Solomon Islands": "Honiara", "South Africa": "Pretoria",
    "Brunei": "Bandar Seri Begawan", "Timor-Leste": "Dili", "the Maldives": "Malé",
    "Barbados": "Bridgetown", "Equatorial Guinea": "Malabo", "Lesotho": "Maseru",
    "Mauritius": "Port Louis",
}


#: Left out of "X is the capital of which country?": the country is in the city's name
#: (Mexico City, ...), a city-state, an official capital other than the best-known city
#: (Sri Lanka), a contested seat (Yemen).
NOT_REVERSED = {"Mexico", "Guatemala", "Panama", "Kuwait", "Singapore", "Sri Lanka", "Yemen"}


#: Countries on one continent that knowledge.jsonl's continent family leaves out (no
#: transcontinental ones, none whose name holds its continent's: South Africa, ...).
MORE_CONTINENTS = {
    "Africa": "Sudan; Somalia; Rwanda; Mozambique; Libya; Namibia; Niger; Chad; "
              "Burkina Faso; Sierra Leone; Liberia; Malawi; Eritrea; Gabon; Togo; Benin; "
              "Mauritania; Burundi; Lesotho; the Democratic Republic of the Congo; "
              "Ivory Coast; the Gambia; South Sudan; Djibouti; Mauritius; Cape Verde",
    "Asia": "Laos; Myanmar; Sri Lanka; Bhutan; North Korea; Singapore; Jordan; Syria; "
            "Lebanon; Oman; Qatar; Kuwait; Yemen; Kyrgyzstan; Tajikistan; Turkmenistan; "
            "Brunei; the Maldives; the United Arab Emirates; Bahrain; Israel",
    "Europe": "Denmark; the Czech Republic; Slovakia; Slovenia; Croatia; Serbia; Romania; "
              "Bulgaria; Estonia; Latvia; Lithuania; Belarus; Ukraine; Luxembourg; Albania; "
              "North Macedonia; Montenegro; Bosnia and Herzegovina; Moldova; Malta; Monaco; "
              "Liechtenstein; Andorra; San Marino",
    "North America": "El Salvador; Belize; the Dominican Republic; the Bahamas; Barbados",
    "Oceania": "the Solomon Islands; Kiribati; Palau; the Marshall Islands; Tuvalu; Nauru",
}


#: Country -> its main spoken language (none with two equally main ones; a widely spoken
#: second one accepted where it rivals the first: Urdu/Punjabi, English/Patois).
LANGUAGE = table("""
France=French; Germany=German; Italy=Italian; Spain=Spanish/Castilian
Portugal=Portuguese; Brazil=Portuguese; Mexico=Spanish; Argentina=Spanish; Chile=Spanish
Colombia=Spanish; Peru=Spanish; Cuba=Spanish; Uruguay=Spanish
Japan=Japanese; China=Mandarin/Chinese/Putonghua; South Korea=Korean; Russia=Russian
Ukraine=Ukrainian; Poland=Polish; Slovakia=Slovak/Slovakian; Hungary=Hungarian/Magyar
Romania=Romanian; Bulgaria=Bulgarian; Greece=Greek; Turkey=Turkish
the Netherlands=Dutch; Sweden=Swedish; Norway=Norwegian; Denmark=Danish; Finland=Finnish
Iceland=Icelandic; Estonia=Estonian; Latvia=Latvian; Lithuania=Lithuanian
Serbia=Serbian; Croatia=Croatian; Slovenia=Slovene/Slovenian; Albania=Albanian
Austria=German; Iran=Persian/Farsi; Egypt=Arabic; Saudi Arabia=Arabic; Iraq=Arabic
Jordan=Arabic; Israel=Hebrew; Thailand=Thai; Vietnam=Vietnamese; Cambodia=Khmer
Laos=Lao/Laotian; Myanmar=Burmese; Indonesia=Indonesian/Bahasa
Malaysia=Malay/Malaysian/Bahasa; Pakistan=Urdu/Punjabi; Bangladesh=Bengali/Bangla
Nepal=Nepali/Nepalese; Mongolia=Mongolian; Tanzania=Swahili/Kiswahili
Somalia=Somali; Australia=English; the United States=English; the United Kingdom=English
New Zealand=English; Jamaica=English/Patois; Angola=Portuguese
Georgia=Georgian; Armenia=Armenian
""")


#: Country -> its currency (singular first; plurals and common English names accepted).
CURRENCY = table("""
Japan=yen; China=yuan/renminbi/RMB; the United Kingdom=pound/pounds/sterling
the United States=dollar/dollars; India=rupee/rupees; Russia=ruble/rouble/rubles/roubles
Switzerland=franc/francs; Mexico=peso/pesos; Brazil=real/reais/reals; South Africa=rand/rands
South Korea=won; Sweden=krona/kronor/crown/crowns; Norway=krone/kroner/crown/crowns
Denmark=krone/kroner/crown/crowns; Iceland=krona/króna/kronur/krónur/crown/crowns
Poland=zloty/złoty/zlotys/zlote/złote; the Czech Republic=koruna/korun/koruny/crown/crowns
Hungary=forint/forints; Turkey=lira/liras/lire; Israel=shekel/shekels/sheqel
Thailand=baht; Vietnam=dong/đồng; Indonesia=rupiah/rupiahs; Malaysia=ringgit/ringgits
the Philippines=peso/pesos/piso; Pakistan=rupee/rupees; Bangladesh=taka/takas
Nigeria=naira/nairas; Kenya=shilling/shillings; Egypt=pound/pounds; Saudi Arabia=riyal/riyals
Canada=dollar/dollars; Australia=dollar/dollars; New Zealand=dollar/dollars
Argentina=peso/pesos; Chile=peso/pesos; Colombia=peso/pesos; Cuba=peso/pesos
Ukraine=hryvnia/hryvnias/hryvnya/grivna; Romania=leu/lei; Morocco=dirham/dirhams
the United Arab Emirates=dirham/dirhams; Iran=rial/rials; Peru=sol/soles
Venezuela=bolívar/bolivar/bolívares/bolivares; Ghana=cedi/cedis; Ethiopia=birr
Mongolia=tögrög/tugrik/togrog/tughrik; Georgia=lari; Armenia=dram; Kazakhstan=tenge
Cambodia=riel/riels; Laos=kip; Myanmar=kyat/kyats; Guatemala=quetzal/quetzales
Costa Rica=colón/colon/colones; Haiti=gourde/gourdes; Paraguay=guaraní/guarani/guaranies
Bolivia=boliviano/bolivianos; Botswana=pula; Zambia=kwacha; Angola=kwanza/kwanzas
Mozambique=metical/meticais; Tanzania=shilling/shillings; Qatar=riyal/riyals/rial
Kuwait=dinar/dinars; Jordan=dinar/dinars; Iraq=dinar/dinars; Algeria=dinar/dinars
Tunisia=dinar/dinars; Serbia=dinar/dinars; Albania=lek/leke; Honduras=lempira/lempiras
Nicaragua=córdoba/cordoba/córdobas/cordobas; Singapore=dollar/dollars
Ecuador=dollar/dollars; Azerbaijan=manat; Afghanistan=afghani/afghanis
Germany=euro/euros; France=euro/euros; Italy=euro/euros; Spain=euro/euros
Portugal=euro/euros; Ireland=euro/euros; Greece=euro/euros; Finland=euro/euros
Austria=euro/euros; the Netherlands=euro/euros; Belgium=euro/euros
""")


#: Country -> what a person from it is (adjective and noun forms accepted).
NATIONALITY = table("""
France=French/Frenchman/Frenchwoman; Germany=German; Italy=Italian; Spain=Spanish/Spaniard
Portugal=Portuguese; the Netherlands=Dutch/Dutchman/Dutchwoman/Netherlander
Belgium=Belgian; Switzerland=Swiss; Austria=Austrian; Denmark=Danish/Dane
Sweden=Swedish/Swede; Norway=Norwegian; Finland=Finnish/Finn; Iceland=Icelandic/Icelander
Ireland=Irish/Irishman/Irishwoman; Poland=Polish/Pole; Hungary=Hungarian/Magyar
Greece=Greek; Turkey=Turkish/Turk; Russia=Russian; Ukraine=Ukrainian; Romania=Romanian
Bulgaria=Bulgarian; Serbia=Serbian/Serb; Croatia=Croatian/Croat; Slovakia=Slovak/Slovakian
Slovenia=Slovenian/Slovene; Estonia=Estonian; Latvia=Latvian; Lithuania=Lithuanian
Belarus=Belarusian/Belarussian/Byelorussian; Albania=Albanian; Malta=Maltese
Cyprus=Cypriot; Luxembourg=Luxembourger/Luxembourgish; Monaco=Monegasque/Monégasque/Monacan
the United Kingdom=British/Briton/Brit; the United States=American; Canada=Canadian
Mexico=Mexican; Cuba=Cuban; Jamaica=Jamaican; Haiti=Haitian; Brazil=Brazilian
Argentina=Argentine/Argentinian/Argentinean; Chile=Chilean; Peru=Peruvian
Colombia=Colombian; Venezuela=Venezuelan; Ecuador=Ecuadorian/Ecuadorean; Bolivia=Bolivian
Uruguay=Uruguayan; Paraguay=Paraguayan; Panama=Panamanian; Costa Rica=Costa Rican
Guatemala=Guatemalan; Honduras=Honduran; Nicaragua=Nicaraguan
El Salvador=Salvadoran/Salvadorean/Salvadorian; China=Chinese; Japan=Japanese
South Korea=South Korean/Korean; North Korea=North Korean; Vietnam=Vietnamese
Thailand=Thai; the Philippines=Filipino/Filipina/Philippine; Indonesia=Indonesian
Malaysia=Malaysian; Singapore=Singaporean; Cambodia=Cambodian/Khmer; Laos=Laotian/Lao
India=Indian; Pakistan=Pakistani; Bangladesh=Bangladeshi; Nepal=Nepali/Nepalese
Sri Lanka=Sri Lankan; Afghanistan=Afghan; Iran=Iranian/Persian; Iraq=Iraqi; Syria=Syrian
Lebanon=Lebanese; Jordan=Jordanian; Israel=Israeli; Yemen=Yemeni; Oman=Omani
Qatar=Qatari; Kuwait=Kuwaiti; Uzbekistan=Uzbek/Uzbekistani; Kazakhstan=Kazakh/Kazakhstani
Mongolia=Mongolian/Mongol; Egypt=Egyptian; Morocco=Moroccan; Algeria=Algerian
Tunisia=Tunisian; Libya=Libyan; Sudan=Sudanese; Ethiopia=Ethiopian; Somalia=Somali/Somalian
Kenya=Kenyan; Uganda=Ugandan; Tanzania=Tanzanian; Rwanda=Rwandan/Rwandese
Nigeria=Nigerian; Ghana=Ghanaian; Senegal=Senegalese; Zimbabwe=Zimbabwean; Zambia=Zambian
Madagascar=Malagasy/Madagascan; Australia=Australian/Aussie
New Zealand=New Zealander/Kiwi; Fiji=Fijian; Georgia=Georgian; Armenia=Armenian
Azerbaijan=Azerbaijani/Azeri
""")


#: US states, Canadian provinces and territories, Australian states and territories.
US_STATES = table("""
Alabama=Montgomery; Alaska=Juneau; Arizona=Phoenix; Arkansas=Little Rock
California=Sacramento; Colorado=Denver; Connecticut=Hartford; Delaware=Dover
Florida=Tallahassee; Georgia=Atlanta; Hawaii=Honolulu; Idaho=Boise; Illinois=Springfield
Indiana=Indianapolis; Iowa=Des Moines; Kansas=Topeka; Kentucky=Frankfort
Louisiana=Baton Rouge; Maine=Augusta; Maryland=Annapolis; Massachusetts=Boston
Michigan=Lansing; Minnesota=Saint Paul/St. Paul; Mississippi=Jackson
Missouri=Jefferson City; Montana=Helena; Nebraska=Lincoln; Nevada=Carson City
New Hampshire=Concord; New Jersey=Trenton; New Mexico=Santa Fe; New York=Albany
North Carolina=Raleigh; North Dakota=Bismarck; Ohio=Columbus; Oklahoma=Oklahoma City
Oregon=Salem; Pennsylvania=Harrisburg; Rhode Island=Providence; South Carolina=Columbia
South Dakota=Pierre; Tennessee=Nashville; Texas=Austin; Utah=Salt Lake City
Vermont=Montpelier; Virginia=Richmond; Washington=Olympia; West Virginia=Charleston
Wisconsin=Madison; Wyoming=Cheyenne
""")


CANADA = table("""
province of Ontario=Toronto; province of Quebec=Quebec City/Québec City
province of British Columbia=Victoria; province of Alberta=Edmonton
province of Manitoba=Winnipeg; province of Saskatchewan=Regina
province of Nova Scotia=Halifax; province of New Brunswick=Fredericton
province of Newfoundland and Labrador=St. John's/Saint John's
province of Prince Edward Island=Charlottetown; territory of Yukon=Whitehorse
territory of the Northwest Territories=Yellowknife; territory of Nunavut=Iqaluit
""")


AUSTRALIA = table("""
state of New South Wales=Sydney; state of Victoria=Melbourne; state of Queensland=Brisbane
state of Western Australia=Perth; state of South Australia=Adelaide
state of Tasmania=Hobart; territory of the Northern Territory=Darwin
""")


#: Landmark -> its country (answers expanded by `countries`).
LANDMARK = table("""
the Taj Mahal=India; the Great Wall=China; Machu Picchu=Peru; Petra=Jordan
Chichen Itza=Mexico; Angkor Wat=Cambodia; the Acropolis of Athens=Greece
the Parthenon=Greece; Stonehenge=the United Kingdom/England; the Colosseum=Italy
the Eiffel Tower=France; the Statue of Liberty=the United States
the Christ the Redeemer statue=Brazil; the Leaning Tower of Pisa=Italy
the Sagrada Família=Spain; the Alhambra=Spain; the Kremlin=Russia; Red Square=Russia
the Forbidden City=China; the Terracotta Army=China; Mount Fuji=Japan
Mount Kilimanjaro=Tanzania; Table Mountain=South Africa; the Grand Canyon=the United States
Uluru=Australia; the Great Barrier Reef=Australia; the Sydney Opera House=Australia
the Brandenburg Gate=Germany; Neuschwanstein Castle=Germany; Hagia Sophia=Turkey
the Blue Mosque=Turkey; the Burj Khalifa=the United Arab Emirates
the Petronas Towers=Malaysia; the Golden Gate Bridge=the United States
Mount Rushmore=the United States; the Hollywood sign=the United States
Easter Island=Chile; the Galápagos Islands=Ecuador; the Louvre=France
the Palace of Versailles=France; Mont Saint-Michel=France; Mount Vesuvius=Italy
Mount Etna=Italy; the Atomium=Belgium; Borobudur=Indonesia
Loch Ness=the United Kingdom/Scotland; Big Ben=the United Kingdom/England
the Tower of London=the United Kingdom/England; the Cliffs of Moher=Ireland
the Blarney Stone=Ireland; the Chernobyl nuclear power plant=Ukraine
the Pyramid of the Sun at Teotihuacan=Mexico
""")


PLURAL_PLACES = {"the Petronas Towers", "the Galápagos Islands", "the Cliffs of Moher"}


#: City (not a capital, no better-known namesake) -> its country.
CITY = table("""
Sydney=Australia; Toronto=Canada; Montreal=Canada; Mumbai=India; Chennai=India
Kolkata=India; Bengaluru=India; Istanbul=Turkey; Shanghai=China; Guangzhou=China
Rio de Janeiro=Brazil; São Paulo=Brazil; Manaus=Brazil; Milan=Italy; Venice=Italy
Munich=Germany; Hamburg=Germany; Frankfurt=Germany; Osaka=Japan; Kyoto=Japan
Nagoya=Japan; Hiroshima=Japan; Yokohama=Japan; Marseille=France; Lyon=France
Johannesburg=South Africa; Cape Town=South Africa; Durban=South Africa
Casablanca=Morocco; Marrakesh=Morocco; Fez=Morocco; Tangier=Morocco; Karachi=Pakistan
Lahore=Pakistan; Ho Chi Minh City=Vietnam; Dubai=the United Arab Emirates
Geneva=Switzerland; Zurich=Switzerland; Kraków=Poland; Gdańsk=Poland; Seville=Spain
Bilbao=Spain; Porto=Portugal; Edinburgh=the United Kingdom/Scotland
Glasgow=the United Kingdom/Scotland; Auckland=New Zealand; Chicago=the United States
Houston=the United States; Detroit=the United States; Seattle=the United States
Las Vegas=the United States; New Orleans=the United States; Busan=South Korea
Mombasa=Kenya; Medellín=Colombia; Antwerp=Belgium; Bruges=Belgium; Rotterdam=the Netherlands
Gothenburg=Sweden; Salzburg=Austria; Thessaloniki=Greece; Jeddah=Saudi Arabia
Mecca=Saudi Arabia; Isfahan=Iran; Cusco=Peru; Timbuktu=Mali; Chiang Mai=Thailand
Kharkiv=Ukraine; Tijuana=Mexico; Acapulco=Mexico; Cancún=Mexico
""")


#: City -> the river through it.
RIVER = table("""
Paris=Seine; London=Thames; Rome=Tiber; Vienna=Danube; Budapest=Danube; Bratislava=Danube
Belgrade=Danube/Sava; Cairo=Nile; Khartoum=Nile; Baghdad=Tigris; Prague=Vltava/Moldau
Berlin=Spree/Havel; Dublin=Liffey; Florence=Arno; Pisa=Arno; Lisbon=Tagus/Tejo
Warsaw=Vistula/Wisła/Wisla; Cologne=Rhine/Rhein; Basel=Rhine/Rhein
New Orleans=Mississippi; Minneapolis=Mississippi; Moscow=Moskva
Saint Petersburg=Neva; Dresden=Elbe; Hamburg=Elbe; Kyiv=Dnieper/Dnipro
Seville=Guadalquivir; Porto=Douro; Glasgow=Clyde; Varanasi=Ganges/Ganga
Bangkok=Chao Phraya; Seoul=Han; Bordeaux=Garonne; Lyon=Rhône/Rhone/Saône/Saone
Geneva=Rhône/Rhone/Arve; Washington, D.C.=Potomac; Turin=Po; Verona=Adige
Salzburg=Salzach; Oxford=Thames/Isis
""")
